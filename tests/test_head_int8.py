"""A speculator head's int8 drafting weights (PreparedLinears(int8=True), load_drafter's ``head_weights``):
where they are used and where not. The product itself (cpu_gemv.gemv_q8) is tested in tests/test_cpu_gemv.py;
the drafting paths (the C call and the step-by-step path on int8 weights, the same bits) and the sampling
distribution with int8 drafts in tests/test_cpu_layers.py."""

import pytest
import torch
import torch.nn.functional as F

from specfoundry.runtime import cpu_gemv, load_drafter
from specfoundry.runtime.drafters.eagle import HEAD_WEIGHTS_ENV, resolve_head_weights
from specfoundry.runtime.engine import PreparedLinears

needs_kernel = pytest.mark.skipif(not cpu_gemv.bf16_available(),
                                  reason=f"the AVX-512 BF16 / VNNI kernels are unavailable: {cpu_gemv.bf16_unavailable_reason()}")


@needs_kernel
def test_prepared_linears_run_few_rows_on_int8_copies_and_follow_edits():
    # a head's few-row products on int8 copies (half the bytes per drafting step), its many-row ones (a
    # prompt's pass) on the bf16 weights; a weight whose inputs are not a multiple of 32 stays bf16
    kernels = ("avx512bf16", "avx512bf16", "aten")
    run, plain = PreparedLinears(kernels, int8=True), PreparedLinears(kernels)
    assert run.int8 and not plain.int8
    assert not PreparedLinears(("aten", "aten"), int8=True).int8  # no AVX-512 BF16 products to replace
    g = torch.Generator().manual_seed(1)
    lin, odd = torch.nn.Linear(128, 96), torch.nn.Linear(40, 64)
    for m in (lin, odd):
        m.weight.data = torch.randn(m.weight.shape, generator=g).bfloat16()
        m.bias.data = torch.randn(m.bias.shape, generator=g).bfloat16()
    for rows, kernel in ((1, "q8"), (5, "q8"), (20, "aten")):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        assert run._takes((lin,), "avx512bf16" if rows <= cpu_gemv.MAX_ROWS else "aten") == kernel
        y, ref = run(lin, x).float(), F.linear(x.float(), lin.weight.float(), lin.bias.float())
        assert (y - ref).norm() <= 0.02 * ref.norm()
        if kernel == "q8":
            assert torch.equal(run(lin, x), cpu_gemv.gemv_q8(x, cpu_gemv.q8_pack(lin.weight), lin.bias))
            assert not torch.equal(run(lin, x), plain(lin, x))  # not the bf16 product
    assert run._takes((odd,), "avx512bf16") == "avx512bf16"
    x = torch.randn(2, 128, generator=g).bfloat16()
    before = run(lin, x)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert torch.allclose(run(lin, x).float() - lin.bias.float(), 2 * (before.float() - lin.bias.float()), rtol=0.02, atol=0.05)


def test_head_weights_choice(monkeypatch):
    monkeypatch.delenv(HEAD_WEIGHTS_ENV, raising=False)
    assert resolve_head_weights() == "int8"
    monkeypatch.setenv(HEAD_WEIGHTS_ENV, "bf16")
    assert resolve_head_weights() == "bf16"
    assert resolve_head_weights("int8") == "int8"  # the caller's choice wins
    with pytest.raises(ValueError, match="head_weights"):
        resolve_head_weights("fp8")
    monkeypatch.setenv(HEAD_WEIGHTS_ENV, "int4")
    with pytest.raises(ValueError, match="head_weights"):
        resolve_head_weights()


@needs_kernel
def test_load_drafter_takes_the_choice(monkeypatch):
    from tiny_models import tiny_llama

    from specfoundry.runtime.engine import LlamaEngine

    monkeypatch.delenv(HEAD_WEIGHTS_ENV, raising=False)
    target = tiny_llama(0, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16)
    target.engine = LlamaEngine(target.model, kernels=("avx512bf16", "avx512bf16"))
    assert load_drafter("eagle3", target=target).head._linears.int8
    assert not load_drafter("eagle3", target=target, head_weights="bf16").head._linears.int8
    assert load_drafter("eagle", target=target).head._linears.int8  # EAGLE-1 heads alike
    with pytest.raises(ValueError, match="head_weights"):
        load_drafter("eagle3", target=target, head_weights="int4")
