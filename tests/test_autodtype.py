"""``dtype="auto"``: the serving dtype is the one whose plain decode step measured fastest; the
chosen target decodes exactly like one loaded in that dtype; the guards and errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.runtime import autodtype
from specfoundry.runtime.models import load_target, wrap_target

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5)
    path = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _greedy(target, n=12):
    ids = torch.arange(1, 9).view(1, -1)
    cache = target.new_cache()
    out = []
    for _ in range(n):
        logits = target.forward(ids, cache).logits[0, -1]
        cache.commit()
        ids = logits.float().argmax().view(1, 1)
        out.append(int(ids))
    return out


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_auto_picks_the_measured_fastest_and_decodes_like_that_dtype(tiny_dir, backend, capsys, monkeypatch):
    # make one candidate slower whatever the machine, so the choice can be checked
    slow = torch.float32
    real = autodtype.plain_step_seconds
    monkeypatch.setattr(autodtype, "plain_step_seconds",
                        lambda t, **kw: real(t, **kw) + (1.0 if t.dtype == slow else 0.0))
    t = load_target(str(tiny_dir), dtype="auto", backend=backend)
    assert t.dtype == torch.bfloat16 and t.backend == backend
    line = capsys.readouterr().err
    assert "dtype auto -> bfloat16" in line and "float32" in line and "ms" in line
    assert _greedy(t) == _greedy(load_target(str(tiny_dir), dtype=torch.bfloat16, backend=backend))
    slow = torch.bfloat16
    t = load_target(str(tiny_dir), dtype="auto", backend=backend)
    assert t.dtype == torch.float32
    assert _greedy(t) == _greedy(load_target(str(tiny_dir), dtype=torch.float32, backend=backend))


def test_step_time_is_measured_on_the_served_path(tiny_dir):
    t = load_target(str(tiny_dir), dtype=torch.float32)
    assert 0 < autodtype.plain_step_seconds(t, reps=2) < 10


def test_without_room_for_a_float32_copy_auto_takes_bfloat16_unmeasured(tiny_dir, monkeypatch):
    monkeypatch.setattr(autodtype.native, "available_memory", lambda: 1000)
    model = LlamaForCausalLM.from_pretrained(tiny_dir)
    dt, info = autodtype.choose(model, lambda m: wrap_target(m), torch.device("cpu"))
    assert dt == torch.bfloat16 and "would not fit" in info["reason"] and "ms_per_token" not in info
    assert "unmeasured" in autodtype.describe("x", dt, info)


def test_bad_dtype_string_is_one_clear_error(tiny_dir):
    with pytest.raises(ValueError, match="torch.dtype or 'auto'"):
        load_target(str(tiny_dir), dtype="float17")


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_auto_is_measured_once_per_machine_then_kept(tiny_dir, capsys, monkeypatch, tmp_path, backend):
    # measured afresh, two processes could serve different dtypes, so different text: the first load keeps it
    from specfoundry.runtime import choices

    monkeypatch.setenv("SPECFOUNDRY_CACHE", str(tmp_path))
    monkeypatch.setenv(choices.CHOICES_ENV, "keep")
    monkeypatch.setattr(choices, "_others_cores", lambda before: 0.0)  # as on a quiet machine
    real = autodtype.plain_step_seconds
    monkeypatch.setattr(autodtype, "plain_step_seconds",
                        lambda t, **kw: real(t, **kw) + (1.0 if t.dtype == torch.bfloat16 else 0.0))
    assert load_target(str(tiny_dir), dtype="auto", backend=backend).dtype == torch.float32
    assert "kept in" in capsys.readouterr().err

    def not_again(t, **kw):
        raise AssertionError("measured although kept")

    monkeypatch.setattr(autodtype, "plain_step_seconds", not_again)
    t = load_target(str(tiny_dir), dtype="auto", backend=backend)
    line = capsys.readouterr().err
    assert t.dtype == torch.float32 and "dtype auto -> float32" in line and "; kept in " in line
    assert _greedy(t) == _greedy(load_target(str(tiny_dir), dtype=torch.float32, backend=backend))
    # another thread count is another choice
    torch.set_num_threads(2)
    try:
        with pytest.raises(AssertionError, match="measured although kept"):
            load_target(str(tiny_dir), dtype="auto", backend=backend)
    finally:
        torch.set_num_threads(1)
