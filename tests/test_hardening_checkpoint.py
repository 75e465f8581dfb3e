"""Hardening of loaded and exported weights (issue 16): non-finite tensors and out-of-range index
tensors are refused at load (not an IndexError mid-generation), at save and at export."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import tiny_llama
from specfoundry.runtime.drafters import load_drafter
from specfoundry.runtime.speculators import CheckpointError, Eagle3Head, MedusaHeads, load_speculator, save_speculator

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, dtype=torch.float32, layers=2)


@pytest.fixture
def saved(tmp_path, target):
    head = Eagle3Head.from_target(target, draft_vocab_size=16, feature_layers=[0, 1, 2])
    head.set_draft_vocab(list(range(0, 64, 4)))
    return save_speculator(head, tmp_path / "spec", target)


def _edit(path, **changes):
    f = path / "model.safetensors"
    t = load_file(str(f))
    for name, fn in changes.items():
        t[name] = fn(t[name].clone())
    save_file(t, str(f), metadata={"format": "pt"})


def _set(index, value):
    def fn(x):
        x.view(-1)[index] = value
        return x
    return fn


def test_out_of_range_d2t_is_refused_at_load(saved, target):
    _edit(saved, d2t=_set(3, 10_000))
    with pytest.raises(CheckpointError, match=r"key 'd2t': token ids must lie in \[0, vocab_size=64\)"):
        load_speculator(saved, target)
    with pytest.raises(CheckpointError, match="d2t"):  # the drafter path too, before any generation
        load_drafter(str(saved), target=target)


def test_negative_or_duplicate_d2t_and_inconsistent_t2d_are_refused(saved, target):
    _edit(saved, d2t=_set(0, -1))
    with pytest.raises(CheckpointError, match="d2t"):
        load_speculator(saved, target)
    _edit(saved, d2t=_set(0, 4))  # 4 twice
    with pytest.raises(CheckpointError, match="distinct"):
        load_speculator(saved, target)
    _edit(saved, d2t=_set(0, 0), t2d=_set(1, True))  # d2t restored; t2d marks an extra id
    with pytest.raises(CheckpointError, match="key 't2d'"):
        load_speculator(saved, target)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(saved, target, value):
    _edit(saved, **{"fc.weight": _set(5, value)})
    with pytest.raises(CheckpointError, match=r"key 'fc.weight': holds 1 non-finite value"):
        load_speculator(saved, target)


def test_non_finite_heads_are_not_saved(tmp_path, target):
    heads = MedusaHeads.from_target(target, num_heads=2)
    with torch.no_grad():
        next(heads.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="refusing to save .* non-finite"):
        save_speculator(heads, tmp_path / "m", target)
    assert not (tmp_path / "m").exists()


def test_drafter_options_in_config_are_validated_at_load(saved, target):
    cfg_file = saved / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for bad, msg in (({"depth": 1_000_000}, "depth"), ({"total_tokens": 0}, "total_tokens"),
                     ({"depth": -2}, "depth"), ({"depth": "5"}, "depth"), ({"tree": "bush"}, "tree"),
                     ({"shape": 3}, "shape")):
        cfg["training"] = {"drafter_options": bad}
        cfg_file.write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=f"training.drafter_options.*{msg}"):
            load_drafter(str(saved), target=target)


def test_export_refuses_non_finite_weights(tmp_path):
    from specfoundry.export.identity import ArtifactError
    from specfoundry.export.serving import SERVING_FORMATS
    from specfoundry.export.source import check_module_finite

    target = tiny_llama(0, dtype=torch.float32)  # 4 layers: feature layers vLLM/SGLang can represent
    head = Eagle3Head.from_target(target, draft_vocab_size=16, feature_layers=[1, 2, 3])
    with torch.no_grad():
        head.fc.weight.view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="fc.weight.*non-finite"):
        check_module_finite(head, "spec")
    for fmt in ("vllm", "sglang"):
        writer = SERVING_FORMATS[fmt][0]
        with pytest.raises(ArtifactError, match="non-finite"):
            writer(head, target, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()


def test_export_cli_refuses_a_run_whose_speculator_holds_nan(tmp_path, capsys):
    from specfoundry.runtime import load_target
    from specfoundry.runtime.cli import main

    tiny = tiny_llama(0, dtype=torch.float32)
    tiny.model.save_pretrained(tmp_path / "target")
    tgt = load_target(str(tmp_path / "target"), dtype=torch.float32)
    head = Eagle3Head.from_target(tgt, draft_vocab_size=16, feature_layers=[1, 2, 3])
    spec = save_speculator(head, tmp_path / "run" / "speculator", tgt)
    _edit(spec, **{"layer.mlp.down_proj.weight": _set(0, float("nan"))})
    code = main(["export", str(tmp_path / "run"), "--target", str(tmp_path / "target"), "--formats", "vllm,sglang"])
    assert code == 2
    assert "non-finite" in capsys.readouterr().err
    assert not (tmp_path / "run" / "export" / "vllm").exists() and not (tmp_path / "run" / "export" / "sglang").exists()


def test_a_draft_model_with_nan_weights_is_refused_at_load(tmp_path, target):
    draft = tiny_llama(1, dtype=torch.float32, layers=1)
    with torch.no_grad():
        draft.model.model.norm.weight[0] = float("nan")
    draft.model.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="draft model tensor .* non-finite"):
        load_drafter(str(tmp_path / "draft"), target=target)


def test_reading_back_an_export_with_nan_is_refused(tmp_path):
    from specfoundry.export.identity import ArtifactError
    from specfoundry.export.serving.vllm import export_vllm, load_vllm

    target = tiny_llama(0, dtype=torch.float32)
    head = Eagle3Head.from_target(target, draft_vocab_size=16, feature_layers=[1, 2, 3])
    export_vllm(head, target, tmp_path / "v")
    f = tmp_path / "v" / "model.safetensors"
    t = load_file(str(f))
    name = next(k for k in t if k.startswith("fc"))
    t[name] = t[name].clone()
    t[name].view(-1)[0] = float("inf")
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match="non-finite"):
        load_vllm(tmp_path / "v", target)


def test_export_cli_refuses_an_out_that_is_a_file(tmp_path, capsys):
    from specfoundry.runtime.cli import main

    (tmp_path / "out").write_text("x")
    assert main(["export", str(tmp_path / "missing-run"), "--out", str(tmp_path / "out")]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing-run")]) == 2
    assert "no such run directory" in capsys.readouterr().err


@pytest.mark.parametrize("kind, key, value, where", [
    ("eagle3", "intermediate_size", 10**9, "model.safetensors: key 'layer.mlp.gate_proj.weight': shape"),
    ("medusa", "num_heads", 10**6, "architecture.num_heads': must be <="),
    ("medusa", "num_layers", 10**6, "architecture.num_layers': must be <="),
])
def test_an_inflated_architecture_in_config_is_refused_before_allocating(tmp_path, target, kind, key, value, where):
    """Checked against the weights' header on a memory-less build: a 10**9-wide MLP would need
    ~128 GB (a MemoryError or the OOM killer) if it were built first."""
    head = (Eagle3Head.from_target(target, draft_vocab_size=16, feature_layers=[0, 1, 2]) if kind == "eagle3"
            else MedusaHeads.from_target(target, num_heads=2, feature_layers=[2]))
    path = save_speculator(head, tmp_path / kind, target)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architecture"][key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=where):
        load_speculator(path, target)


@pytest.mark.parametrize("key, value, where", [
    ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}, "rope_parameters.rope_type"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": float("nan")}, "rope_parameters.rope_theta"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0}, "rope_parameters.rope_theta"),
    ("hidden_act", "bogus", "architecture.hidden_act"),
    ("rms_norm_eps", float("nan"), "architecture.rms_norm_eps"),
])
def test_bad_architecture_values_in_config_are_one_checkpoint_error(saved, target, key, value, where):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["architecture"][key] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=where):
        load_speculator(saved, target)


def test_onnx_export_refuses_non_finite_weights(tmp_path):
    from specfoundry.export.onnx import export_all

    target = tiny_llama(0, dtype=torch.float32)
    head = Eagle3Head.from_target(target, draft_vocab_size=16, feature_layers=[1, 2, 3])
    with torch.no_grad():
        head.lm_head.weight.view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match="lm_head.weight.*non-finite"):
        export_all(target, head, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()
