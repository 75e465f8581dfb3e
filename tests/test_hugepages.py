"""The engine's huge-page arena: alignment and bounds of the arena, the mode read from the kernel's
file, and an engine whose matrices live in one arena (the HF modules re-pointed, a tied LM head
kept tied) computing the same logits, bit for bit, as one on the model's own tensors."""

import pytest
import torch

from specfoundry.runtime import hugepages
from specfoundry.runtime.engine import LlamaEngine
from test_engine import _model

pytestmark = pytest.mark.usefixtures("single_thread")


def test_arena_is_huge_page_aligned_and_hands_out_cache_line_aligned_tensors():
    shapes = [(3, 5), (7, 32), (1, 1), (64, 48)]
    arena = hugepages.Arena(shapes, torch.bfloat16)
    got = [arena.take(s) for s in shapes]
    assert got[0].data_ptr() % hugepages.HUGE_PAGE == 0
    for t, s in zip(got, shapes):
        assert tuple(t.shape) == s and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert t.data_ptr() % 64 == 0
    for a, b in zip(got, got[1:]):  # consecutive, never overlapping
        assert a.data_ptr() + a.numel() * 2 <= b.data_ptr()
    with pytest.raises(ValueError, match="bytes left"):
        arena.take((1,))


def test_thp_mode_reads_the_bracketed_value(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP", str(f))
    assert hugepages.thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never" and not hugepages.wanted()
    monkeypatch.setattr(hugepages, "_THP", str(tmp_path / "missing"))
    assert hugepages.thp_mode() is None and not hugepages.wanted()


def test_the_variable_turns_the_arena_off(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "always")
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.wanted()
    monkeypatch.setenv(hugepages.ENV, "1")
    assert hugepages.wanted() == hugepages.sys.platform.startswith("linux")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_matrices_in_one_arena_give_the_same_logits(arch, monkeypatch):
    kernels = ("aten", "aten")
    monkeypatch.setattr(hugepages, "wanted", lambda: False)
    plain_model = _model(arch).to(torch.bfloat16)
    plain = LlamaEngine(plain_model, kernels)
    monkeypatch.setattr(hugepages, "wanted", lambda: True)
    model = _model(arch).to(torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.get_output_embeddings().weight is model.model.embed_tokens.weight
    eng = LlamaEngine(model, kernels)
    # every streamed matrix in the arena's one storage, the HF modules pointing at it, the LM head still tied
    storages = {eng.layers[i][k].untyped_storage().data_ptr() for i in range(len(eng.layers))
                for k in ("wqkv", "wo", "w_gu", "w_down")} | {eng.lm_head.untyped_storage().data_ptr()}
    assert len(storages) == 1 and plain.lm_head.untyped_storage().data_ptr() not in storages
    layer = model.model.layers[1]
    assert layer.self_attn.o_proj.weight.data_ptr() == eng.layers[1]["wo"].data_ptr()
    assert layer.mlp.down_proj.weight.data_ptr() == eng.layers[1]["w_down"].data_ptr()
    assert layer.self_attn.q_proj.weight.data_ptr() == eng.layers[1]["wqkv"].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == eng.layers[1]["w_gu"][layer.mlp.gate_proj.weight.shape[0]:].data_ptr()
    assert model.get_output_embeddings().weight is model.model.embed_tokens.weight is eng.embed
    assert eng.lm_head.data_ptr() == eng.embed.data_ptr()
    # the same weights (tied here: the plain model's head is its embedding too) give the same bits
    with torch.no_grad():
        plain_model.get_output_embeddings().weight.copy_(model.model.embed_tokens.weight)
    plain = LlamaEngine(plain_model, kernels)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    pos = torch.arange(6).view(1, 6)
    with torch.inference_mode():
        a = plain.forward(ids, plain.new_cache(capacity=8), pos)
        b = eng.forward(ids, eng.new_cache(capacity=8), pos)
    assert torch.equal(a.logits, b.logits)
