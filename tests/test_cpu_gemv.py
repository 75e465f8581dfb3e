"""The few-row kernels (runtime/cpu_gemv.py: AVX2, AVX-512 BF16, AMX): equal to F.linear within
rounding, the same bits for a row whatever else is in the product, greedy speculation on them equal
to plain decoding, and the engine's measured choice may pick them. Each kernel's tests are skipped,
with the reason, on CPUs without its instructions."""

import pytest
import torch
import torch.nn.functional as F

from specfoundry.runtime import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=f"avx2 kernel unavailable: "
                                f"{cpu_gemv.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
def test_gemv_equals_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(72, 40, generator=g).to(dtype)
    b = torch.randn(72, generator=g).to(dtype)
    x = torch.randn(2, rows, 40, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    got = cpu_gemv.gemv(x, w, b)
    assert got.shape == (2, rows, 72) and got.dtype == dtype
    # fp32 accumulation, one rounding into the weights' dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(dtype):
    # what makes a verification's logits for a token equal a plain step's (no kernel switch by rows)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 64, generator=g).to(dtype)
    x = torch.randn(8, 64, generator=g).to(dtype)
    alone = torch.cat([cpu_gemv.gemv(x[i:i + 1], w) for i in range(8)])
    for n in (2, 5, 8):
        assert torch.equal(cpu_gemv.gemv(x[:n], w), alone[:n])
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        other_threads = cpu_gemv.gemv(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(other_threads, alone)


def test_gemv_refuses_weights_it_cannot_take():
    with pytest.raises(ValueError, match="multiple of 8 inputs"):
        cpu_gemv.gemv(torch.randn(1, 12), torch.randn(4, 12))
    with pytest.raises(ValueError, match="contiguous CPU bf16/fp32"):
        cpu_gemv.gemv(torch.randn(1, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64))


def test_engine_routes_rows_past_the_kernel_to_the_bulk_kernel():
    from specfoundry.runtime.engine import FP32_ROWS, kernel_for, kernels_used

    assert kernel_for(("avx2", "avx2"), 1) == "avx2"
    assert kernel_for(("avx2", "avx2"), cpu_gemv.MAX_ROWS) == "avx2"
    assert kernel_for(("avx2", "avx2"), cpu_gemv.MAX_ROWS + 1) == "aten"
    assert kernel_for(("onednn", "avx2"), 64) == "onednn"
    assert kernel_for(("gemv_t", "avx2", "onednn"), 9) == "onednn" and kernel_for(("gemv_t", "avx2", "aten"), 9) == "aten"
    assert kernel_for(("gemv_t", "onednn"), 64) == "onednn" and kernel_for(("gemv_t", "onednn"), 1) == "gemv_t"
    # AMX keeps up to AMX_ROWS rows (a larger tree verified on a plain step's products); more go to the bulk kernel
    amx = ("amx", "amx", "onednn")
    assert [kernel_for(amx, n) for n in (1, cpu_gemv.MAX_ROWS + 1, cpu_gemv.AMX_ROWS, cpu_gemv.AMX_ROWS + 1)] == \
        ["amx", "amx", "amx", "onednn"]
    assert kernel_for(("avx512bf16", "avx512bf16", "amx"), cpu_gemv.MAX_ROWS + 1) == "amx"  # (a head's: its bulk)
    assert kernels_used(("amx", "amx")) == {"amx", "aten"}  # what the many-row products need is prepared
    bf16_fp32 = ("avx512bf16", "avx512bf16", "fp32")
    assert [kernel_for(bf16_fp32, n) for n in (1, cpu_gemv.MAX_ROWS + 1, FP32_ROWS - 1, FP32_ROWS)] == \
        ["avx512bf16", "avx512bf16", "avx512bf16", "fp32"] and kernels_used(bf16_fp32) == {"avx512bf16", "fp32"}


@pytest.mark.parametrize("dtype,bulk", [(torch.float32, "avx2"), (torch.bfloat16, "avx2"), (torch.bfloat16, "fp32")])
def test_speculative_greedy_equals_plain_on_the_avx2_kernel(dtype, bulk):
    # the kernel forced for every row count (chains/trees verify through it, prefill in passes of 8), or
    # for 1-63 rows with the 66-token prompts' prefill on the fp32 copies (engine KERNELS "fp32"):
    # speculative greedy output must be the plain greedy output token for token
    from transformers import LlamaConfig, LlamaForCausalLM

    from specfoundry.runtime import SpeculativeGenerator, load_drafter
    from specfoundry.runtime.engine import EngineTarget, LlamaEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    target = EngineTarget(model)
    target.engine = LlamaEngine(model, kernels=("avx2", "avx2", bulk))
    assert any(k.endswith("@" + bulk) for k in target.engine.layers[0])  # its weights prepared
    g = torch.Generator().manual_seed(3)
    for source, opts in (("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}), ("eagle3", {"depth": 3})):
        gen = SpeculativeGenerator(target, load_drafter(source, target=target, **opts), adaptive=False)
        for _ in range(3):
            base = torch.randint(0, 96, (6,), generator=g).tolist()
            prompt = base * (11 if bulk == "fp32" else 3)  # repeats give the n-gram drafter matches
            kw = dict(prompt_ids=prompt, max_new_tokens=24, stop_at_eos=False)
            spec, plain = gen.generate(**kw), gen.generate(speculate=False, **kw)
            assert spec.token_ids == plain.token_ids, (source, opts)
            assert spec.stats.target_forwards <= plain.stats.target_forwards


# -- the AVX-512 BF16 kernel (gemv_bf16); not run on CPUs without avx512_bf16 ---------------------------
needs_bf16 = pytest.mark.skipif(not cpu_gemv.bf16_available(), reason=f"avx512bf16 kernel unavailable: "
                                f"{cpu_gemv.bf16_unavailable_reason()}")


@pytest.fixture(params=["vdpbf16ps", "fma"])
def bf16_path(request):
    """The AVX-512 BF16 kernel with every pass on one path, whichever cpu_gemv.fma_rows chose here
    (restored after); the FMA path only where it gives vdpbf16ps's bits on this CPU."""
    if request.param == "fma" and not cpu_gemv.fma_exact():
        pytest.skip("the FMA path does not give vdpbf16ps's bits on this CPU (cpu_gemv.fma_rows never uses it here)")
    lib = cpu_gemv._load_bf16()[0]
    cpu_gemv.fma_rows()
    cpu_gemv.set_fma_rows(lib, range(1, 9) if request.param == "fma" else ())
    yield request.param
    cpu_gemv.set_fma_rows(lib, cpu_gemv.fma_rows())


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 20])
@pytest.mark.parametrize("shape", [(72, 40), (130, 64), (33, 34), (7, 1536)])  # in % 32 != 0: the masked tail
def test_gemv_bf16_equals_linear(rows, shape, bf16_path):  # 2 * rows rows of x
    x, w, b = _bf16_case(rows, shape)
    _assert_is_linear(cpu_gemv.gemv_bf16(x, w, b), x, w, b)
    assert torch.equal(cpu_gemv.gemv_bf16(x, w), cpu_gemv.gemv_bf16(x, w, torch.zeros_like(b)))


def _bf16_case(rows: int, shape: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """x ``[2, rows, in]``, w ``[out, in]``, b ``[out]``: random bf16."""
    g = torch.Generator().manual_seed(rows)
    out_f, in_f = shape
    return (torch.randn(2, rows, in_f, generator=g).bfloat16(), torch.randn(out_f, in_f, generator=g).bfloat16(),
            torch.randn(out_f, generator=g).bfloat16())


def _assert_is_linear(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> None:
    ref = F.linear(x.double(), w.double(), b.double())
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    # exact products, fp32 sums, one rounding to bf16 (2^-8 relative)
    assert (got.double() - ref).abs().max() <= 8e-3 * ref.abs().max()


@needs_bf16
def test_gemv_bf16_gives_a_row_the_same_bits_alone_and_in_any_batch(bf16_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(131, 96, generator=g).bfloat16()  # 131 outputs: a last group of 3 (sf_finish)
    x = torch.randn(11, 96, generator=g).bfloat16()
    _assert_rows_independent(lambda xs: cpu_gemv.gemv_bf16(xs, w), x, (2, 3, 4, 5, 8, 9, 11))


def _assert_rows_independent(product, x: torch.Tensor, sizes: tuple[int, ...]) -> None:
    """``product`` of the first n rows of ``x`` (each n in ``sizes``, and all rows at another thread
    count) gives each row the bits it gets alone."""
    alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
    for n in sizes:
        assert torch.equal(product(x[:n]), alone[:n])
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        assert torch.equal(product(x), alone)
    finally:
        torch.set_num_threads(before)


@needs_bf16
@pytest.mark.parametrize("shape", [(37, 144), (131, 96), (40, 100), (17, 1536), (50, 64)])
def test_gemv_bf16_sums_in_its_documented_order(shape, bf16_path):
    # every output's sum order, rebuilt step by step in fp32: a verification's rows give a plain step's
    # bits only while every product keeps this order (the 16-output reduction included: sf_take)
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16()
    x = torch.randn(9, shape[1], generator=g).bfloat16()
    if shape == (37, 144):  # with random data the order hardly shows at bf16 resolution: outputs where it does
        x[0], big = 1.0, 2.0 ** 24  # (2^24 + 1 rounds to 2^24; 1 - 2^24 is exact)
        w[:4] = 0
        w[0, [1, 17, 9, 25]] = torch.tensor([big, 1.0, -big, 1.0]).bfloat16()  # lanes 0, 8, 4, 12: pairs i, i + 8 first
        w[1, [1, 64, 65]] = torch.tensor([big, -big, 1.0]).bfloat16()  # a lane adds its odd product, then its even one
        w[2, [1, 33, 65, 97]] = torch.tensor([big, 1.0, -big, 1.0]).bfloat16()  # blocks alternate between two sums
        w[3, [1, 33, 129]] = torch.tensor([-big, big, 1.0]).bfloat16()  # the partial last block joins the second
    for n in (1, 2, 3, 4, 5, 8, 9):  # 9: a pass of 8 rows of x and one of 1
        for bias in (b, None):
            got = cpu_gemv.gemv_bf16(x[:n], w, bias)
            assert torch.equal(got.view(torch.int16), _bf16_sum_order(x[:n], w, bias).view(torch.int16)), (n, bias is None)


def _bf16_sum_order(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in fp32 steps (inputs without denormals, so DAZ/FTZ never shows): 16 lanes per
    output, lane l taking inputs 2l and 2l + 1 of each block of 32 (its odd product added first); full blocks
    alternate between two sums (even blocks, odd ones), a last partial block goes to the second; the two
    sums added, the lanes reduced in pairs (i + 8, i + 4, i + 2, i + 1), the bias added, rounded to bf16."""
    n, inp = x.shape
    full, nb = inp // 32, -(-inp // 32)
    xs = F.pad(x.float(), (0, nb * 32 - inp)).view(n, 1, nb, 16, 2)
    ws = F.pad(w.float(), (0, nb * 32 - inp)).view(1, -1, nb, 16, 2)
    prod = xs * ws  # exact: bf16 products fit fp32
    sums = torch.zeros(2, n, w.shape[0], 16)
    for blk in range(nb):
        k = blk % 2 if blk < full else 1
        sums[k] = (sums[k] + prod[:, :, blk, :, 1]) + prod[:, :, blk, :, 0]
    s = sums[0] + sums[1]
    for half in (8, 4, 2, 1):
        s = s[..., :half] + s[..., half:2 * half]
    total = s[..., 0] + (bias.float() if bias is not None else 0.0)
    return total.bfloat16()


@needs_bf16
@pytest.mark.skipif(not cpu_gemv.fma_exact(), reason="the FMA path does not give vdpbf16ps's bits on this CPU")
@pytest.mark.parametrize("shape", [(72, 40), (131, 96), (33, 34), (7, 1536), (40, 576)])
def test_the_fma_path_gives_vdpbf16ps_bits(shape):
    # which path a pass of rows takes (cpu_gemv.fma_rows: chosen by speed) must never show in a result:
    # a verification's rows would otherwise differ from a plain step's one row
    lib = cpu_gemv._load_bf16()[0]
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g).bfloat16()
    b = torch.randn(shape[0], generator=g).bfloat16()
    x = (torch.randn(11, shape[1], generator=g) * 10.0 ** torch.arange(-36, 4, 4).repeat(2)[:11, None]).bfloat16()
    # rows where the arithmetic's details show at bf16 resolution (with random data they hardly do):
    # the order within a lane (2^24 + 1 rounds away before -2^24 cancels it: 0 if a block's odd product
    # comes first, 1 if its even one does; blocks 0 and 2 share a lane's sum), denormal inputs times
    # large weights (vdpbf16ps reads them as zero), sums of tiny products (it flushes denormal sums)
    if shape[1] >= 96:
        w[:, [1, 64, 65]] = torch.tensor([2.0 ** 12, -(2.0 ** 12), 1.0]).bfloat16()
        x[0] = 0
        x[0, [1, 64, 65]] = torch.tensor([2.0 ** 12, 2.0 ** 12, 1.0]).bfloat16()
    x[1] = 1e-39
    w[0] = 1e30
    x[2] = 1e-20
    w[1] = 1e-20
    try:
        for n, bias in [(n, bias) for n in range(1, 12) for bias in (b, None)]:  # (no bias: tiny sums show)
            cpu_gemv.set_fma_rows(lib, ())
            ref = cpu_gemv.gemv_bf16(x[:n], w, bias)
            cpu_gemv.set_fma_rows(lib, range(1, 9))
            assert torch.equal(cpu_gemv.gemv_bf16(x[:n], w, bias), ref), n
            # a caller's flag for its 2-row passes over streamed weights (the engine's fma2): 2 rows, and
            # 10 = a pass of 8 then one of 2
            cpu_gemv.set_fma_rows(lib, ())
            assert torch.equal(cpu_gemv.gemv_bf16(x[:n], w, bias, fma2=True), ref), n
        ref10 = cpu_gemv.gemv_bf16(x[:10], w, b)
        assert torch.equal(cpu_gemv.gemv_bf16(x[:10], w, b, fma2=True), ref10)
    finally:
        cpu_gemv.set_fma_rows(lib, cpu_gemv.fma_rows())


@needs_bf16
def test_the_kernel_leaves_the_threads_floating_point_mode_as_it_was():
    # it runs its sums with denormals flushed (as vdpbf16ps does) on torch's own OpenMP threads:
    # left set, every later torch op on those threads would flush them too
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(4096, 64).bfloat16()
    cpu_gemv.gemv_bf16(x, w)
    tiny = torch.full((1 << 20,), 1e-39)  # float32 denormals, work for every thread
    assert bool((tiny * 1.0).ne(0).all()) and bool((tiny + tiny).eq(2e-39).all())


@needs_bf16
def test_fma_rows_chooses_among_several_row_passes_only():
    rows = cpu_gemv.fma_rows()
    assert set(rows) <= set(range(2, cpu_gemv.MAX_ROWS + 1))  # one row (a plain step) keeps vdpbf16ps
    if not cpu_gemv.fma_exact():
        assert rows == ()


@needs_bf16
def test_gemv_bf16_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="bf16 inputs"):
        cpu_gemv.gemv_bf16(torch.randn(1, 16), torch.randn(4, 16).bfloat16())
    with pytest.raises(ValueError, match="even"):
        cpu_gemv.gemv_bf16(torch.randn(1, 15).bfloat16(), torch.randn(4, 15).bfloat16())


@needs_bf16
def test_engine_kernel_avx512bf16_leaves_other_dtypes_to_aten():
    from specfoundry.runtime.engine import KERNELS, kernel_for

    apply = KERNELS["avx512bf16"][1]
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    assert torch.equal(apply(x, w), F.linear(x, w))  # e.g. a head kept in float32 reusing the target's choice
    assert kernel_for(("avx512bf16", "avx512bf16", "onednn"), cpu_gemv.MAX_ROWS + 1) == "onednn"
    assert kernel_for(("avx512bf16", "avx512bf16"), 3) == "avx512bf16"


@needs_bf16
def test_speculative_greedy_equals_plain_on_the_avx512bf16_kernel():
    # bf16 target, the kernel forced for one-row and several-row products: every verified token's
    # logits come from the same per-row sums as a plain step's, so greedy outputs match exactly
    from tiny_models import assert_greedy_speculation_is_plain, tiny_llama

    from specfoundry.runtime.engine import LlamaEngine

    target = tiny_llama(0, vocab=96, hidden=64, layers=3, dtype=torch.bfloat16, init_std=0.02)
    target.engine = LlamaEngine(target.model, kernels=("avx512bf16", "avx512bf16", "avx512bf16"))
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3})], vocab=96)


def test_cost_curve_measures_where_the_few_row_kernels_hand_over():
    # products of MAX_ROWS + 1 rows go to the many-row kernel, a jump the policy must see (an
    # interpolation between 8 and 16 priced such steps too cheap)
    import inspect

    from specfoundry.runtime.engine import EngineTarget

    sizes = inspect.signature(EngineTarget.cost_curve).parameters["sizes"].default
    assert {cpu_gemv.MAX_ROWS, cpu_gemv.MAX_ROWS + 1} <= set(sizes)


# -- the AMX kernel (gemv_amx); not run on CPUs without AMX tiles (AMD, Intel before Sapphire Rapids) ----
needs_amx = pytest.mark.skipif(not cpu_gemv.amx_available(), reason=f"amx kernel unavailable: "
                               f"{cpu_gemv.amx_unavailable_reason()}")


@needs_amx
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 20])  # 2 * rows rows of x: 16 and 18 (two groups) included
@pytest.mark.parametrize("shape", [(32, 32), (96, 128), (64, 1536)])
def test_gemv_amx_equals_linear(rows, shape):
    x, w, b = _bf16_case(rows, shape)
    wp = cpu_gemv.amx_pack(w)
    _assert_is_linear(cpu_gemv.gemv_amx(x, wp, b), x, w, b)
    assert torch.equal(cpu_gemv.gemv_amx(x, wp), cpu_gemv.gemv_amx(x, wp, torch.zeros_like(b)))


@needs_amx
def test_gemv_amx_gives_a_row_the_same_bits_alone_and_in_any_batch():
    # up to 16 rows of x are one tile (the last group narrower): a row gets the same sums in any group
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 192, generator=g).bfloat16()
    wp = cpu_gemv.amx_pack(w)
    x = torch.randn(37, 192, generator=g).bfloat16()
    _assert_rows_independent(lambda xs: cpu_gemv.gemv_amx(xs, wp), x, (2, 3, 4, 8, 15, 16, 17, 32, 33, 37))


@needs_amx
def test_gemv_amx_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_gemv.amx_pack(torch.randn(33, 64).bfloat16())
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_gemv.amx_pack(torch.randn(32, 64))  # fp32
    w = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="amx_pack"):
        cpu_gemv.gemv_amx(torch.randn(1, 64).bfloat16(), w)  # not packed
    with pytest.raises(ValueError, match="bf16 inputs"):
        cpu_gemv.gemv_amx(torch.randn(1, 64), cpu_gemv.amx_pack(w))


@needs_amx
def test_speculative_greedy_equals_plain_on_the_amx_kernel():
    # the op-by-op forward (head_dim 16: no layer kernel) with every product on the tiles, more than
    # 8 rows included: plain steps and verifications take each token's sums in the same order
    from tiny_models import assert_greedy_speculation_is_plain, tiny_llama

    from specfoundry.runtime.engine import LlamaEngine

    target = tiny_llama(0, vocab=96, hidden=64, layers=3, dtype=torch.bfloat16, init_std=0.02)
    target.engine = LlamaEngine(target.model, kernels=("amx", "amx", "amx"))
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}),
                                                ("eagle3", {"depth": 3, "total_tokens": 12})], vocab=96)


def test_the_kernel_table_lists_what_runs_here():
    # python -m specfoundry.bench.kernels: every kernel that runs on this CPU and these weights, and
    # none that cannot (AMX takes bf16 only; on an fp32 target it is left out, not an error)
    from tiny_models import tiny_llama

    from specfoundry.bench.kernels import kernel_table
    from specfoundry.runtime.engine import LlamaEngine

    for dtype in (torch.float32, torch.bfloat16):
        target = tiny_llama(0, vocab=96, hidden=64, layers=2, dtype=dtype, init_std=0.02)
        table = kernel_table(LlamaEngine(target.model, kernels=("aten", "aten")), rows=(1, 4), reps=1)
        assert set(table["aten"]) == {1, 4} and all(v > 0 for v in table["aten"].values())
        assert ("amx" in table) == (dtype == torch.bfloat16 and cpu_gemv.amx_available())
        assert ("avx512bf16" in table) == (dtype == torch.bfloat16 and cpu_gemv.bf16_available())


# int8 weights (a speculator head's drafting products, cpu_gemv.gemv_q8; where they are used: test_head_int8.py)


def _q8_reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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


@needs_bf16
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
    ref = _q8_reference(x, packed, bias)
    # the kernel's fp32 sums and one rounding to bf16
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-3 * ref.abs().max()).all()
    assert torch.equal(y[:, 1], bias[1].expand(rows))
    # and the product of the weights as trained, within int8's rounding (a few parts per thousand here)
    exact = x.double() @ w.double().t() + bias.double()
    assert (y.double() - exact).norm() <= 0.02 * exact.norm()


@needs_bf16
def test_gemv_q8_sums_past_what_an_int32_lane_holds():
    # equal signs everywhere: 32,768 inputs of 127 * 32767 each would overflow the int32 lanes without the
    # kernel's move into fp32 every 8,192 inputs
    w = torch.full((3, 32768), 0.5).bfloat16()
    x = torch.full((2, 32768), 3.0).bfloat16()
    y = cpu_gemv.gemv_q8(x, cpu_gemv.q8_pack(w))
    assert torch.equal(y, torch.full((2, 3), 32768 * 1.5).bfloat16())


@needs_bf16
def test_gemv_q8_gives_a_row_the_same_bits_alone_and_in_any_batch():
    # each row of x has its own int16 scale: its outputs do not depend on the other rows or the threads
    g = torch.Generator().manual_seed(0)
    packed = cpu_gemv.q8_pack(torch.randn(300, 576, generator=g).bfloat16())
    x = torch.randn(13, 576, generator=g).bfloat16()
    _assert_rows_independent(lambda xs: cpu_gemv.gemv_q8(xs, packed), x, (2, 5, 8, 9, 13))


@needs_bf16
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
