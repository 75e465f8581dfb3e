"""A speculator head's int8 drafting weights (cpu_gemv.q8_pack / gemv_q8, PreparedLinears(int8=True),
load_drafter's ``head_weights``): the product's rule, its determinism, where it is used and where not.
The drafting paths themselves (the C call and the step-by-step path on int8 weights, the same bits) and the
sampling distribution with int8 drafts are in tests/test_cpu_layers.py."""

import pytest
import torch
import torch.nn.functional as F

from specfoundry.runtime import cpu_gemv, load_drafter
from specfoundry.runtime.drafters.eagle import HEAD_WEIGHTS_ENV, resolve_head_weights
from specfoundry.runtime.engine import PreparedLinears

needs_kernel = pytest.mark.skipif(not cpu_gemv.bf16_available(),
                                  reason=f"the AVX-512 BF16 / VNNI kernels are unavailable: {cpu_gemv.bf16_unavailable_reason()}")


def _reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's rule in float64: each row of x to int16 by max|x| / 32767 (round half to even), exact
    integer sums, times both scales, plus the bias."""
    inn = packed.shape[1] - 4
    q = packed[:, :inn].contiguous().view(torch.int8).double()
    s = packed[:, inn:].contiguous().view(torch.float32).view(-1).double()
    xf = x.double()
    sx = (xf.abs().amax(1, keepdim=True) / 32767).float().double()  # the kernel's fp32 scale
    xq = torch.round(xf * (32767 / xf.abs().amax(1, keepdim=True)).float().double()).clamp(-32768, 32767)
    y = (xq @ q.t()) * sx * s
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("shape", [(96, 64), (576, 1728), (40, 16448)])  # 16448: two flushes, the last partial
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_gemv_q8_computes_its_rule_and_is_close_to_the_bf16_product(shape, rows):
    g = torch.Generator().manual_seed(rows)
    out, inn = shape
    w = (torch.randn(out, inn, generator=g) * 0.05).bfloat16()
    w[1] = 0  # a zero row: scale 0, outputs 0 (plus the bias)
    packed = cpu_gemv.q8_pack(w)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (out, inn + 4)
    big = 200.0 if inn > 8192 else 2.0  # large inputs: sums past an int32 lane without the flush
    x = (torch.randn(rows, inn, generator=g) * big).bfloat16()
    x[:, 5] = big * 3  # every row's largest entry quantizes to 32767 exactly
    w[2] = w[2].abs().max()  # a row of equal weights quantizes to 127 everywhere
    packed = cpu_gemv.q8_pack(w)
    bias = torch.randn(out, generator=g).bfloat16()
    y = cpu_gemv.gemv_q8(x, packed, bias)
    ref = _reference(x, packed, bias)
    # the kernel's fp32 sums and one rounding to bf16
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3 * ref.abs().max()).all()
    assert torch.equal(y[:, 1], bias[1].expand(rows))
    # and the product of the weights as trained, within int8's rounding (a few parts per thousand here)
    exact = x.double() @ w.double().t() + bias.double()
    assert (y.double() - exact).norm() <= 0.02 * exact.norm()


@needs_kernel
def test_gemv_q8_sums_past_what_an_int32_lane_holds():
    # equal signs everywhere: 32,768 inputs of 127 * 32767 each would overflow the int32 lanes without the
    # kernel's move into fp32 every 8,192 inputs
    w = torch.full((3, 32768), 0.5).bfloat16()
    x = torch.full((2, 32768), 3.0).bfloat16()
    y = cpu_gemv.gemv_q8(x, cpu_gemv.q8_pack(w))
    assert torch.equal(y, torch.full((2, 3), 32768 * 1.5).bfloat16())


@needs_kernel
def test_gemv_q8_gives_a_row_the_same_bits_alone_in_any_batch_and_thread_count():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 576, generator=g).bfloat16()
    packed = cpu_gemv.q8_pack(w)
    x = torch.randn(13, 576, generator=g).bfloat16()
    ys = cpu_gemv.gemv_q8(x, packed)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for r in (0, 6, 12):
                assert torch.equal(cpu_gemv.gemv_q8(x[r:r + 1], packed), ys[r:r + 1])
            assert torch.equal(cpu_gemv.gemv_q8(x[4:9], packed), ys[4:9])
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_gemv_q8_keeps_non_finite_rows_non_finite_and_refuses_what_it_cannot_take():
    w = torch.randn(64, 96).bfloat16()
    packed = cpu_gemv.q8_pack(w)
    x = torch.randn(3, 96).bfloat16()
    x[1, 7], x[2, 0] = float("nan"), float("inf")
    y = cpu_gemv.gemv_q8(x, packed)
    assert y[0].isfinite().all() and y[1].isnan().all() and y[2].isnan().all()
    assert torch.equal(cpu_gemv.gemv_q8(torch.zeros(2, 96).bfloat16(), packed), torch.zeros(2, 64).bfloat16())
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_gemv.q8_pack(torch.randn(8, 40))
    with pytest.raises(ValueError, match="q8_pack weight"):
        cpu_gemv.gemv_q8(x, w)  # a bf16 weight
    with pytest.raises(ValueError, match="q8_pack weight"):
        cpu_gemv.gemv_q8(x.float(), packed)


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
