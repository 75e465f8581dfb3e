"""One sequence's AVX-512 BF16 decode/verification attention (runtime/cpu_attention.py
decode_attention): equal to float64 attention within bf16 rounding for random trees, closer than
SDPA; a chain token's or a tree node's output the same bits as when decoded alone after the commit; the engine's
forward takes it for a bf16 batch-1 step and its logits stay those of the SDPA path. The prefill on the same
kernel (prefill_attention, the causal triangle): equal to float64 as closely as SDPA, a row's output
independent of the tokens after it, taken by the engine's prefill with SDPA's logits. Not run on
CPUs without avx512_bf16 (the engine keeps SDPA there)."""

import pytest
import torch
from tiny_models import assert_greedy_speculation_is_plain, tiny_llama

from specfoundry.runtime import cpu_attention
from specfoundry.runtime.kvcache import attend
from specfoundry.runtime.tree import ancestor_matrix

pytestmark = pytest.mark.skipif(cpu_attention._load_decode()[0] is None,
                                reason=f"decode attention kernel unavailable: {cpu_attention._load_decode()[1]}")


def _tree(n, g):
    return torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]])


def _reference(layer, q, past, block, scale):
    n, hq, D = q.shape[1:]
    g = hq // layer.shape[2]
    K = layer[0, 0, :, : past + n].double().repeat_interleave(g, 0)
    V = layer[1, 0, :, : past + n].double().repeat_interleave(g, 0)
    allow = torch.ones(n, past + n, dtype=torch.bool)
    allow[:, past:] = block[0] if block is not None else torch.ones(n, n, dtype=torch.bool).tril()
    s = torch.einsum("nhd,hcd->hnc", q[0].double(), K) * scale
    p = torch.softmax(s.masked_fill(~allow, float("-inf")), -1)
    return torch.einsum("hnc,hcd->nhd", p, V).reshape(1, n, hq * D)


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("n,past", [(1, 0), (1, 37), (3, 16), (8, 100), (16, 7)])
def test_decode_attention_equals_float64_and_is_closer_than_sdpa(D, n, past):
    g = torch.Generator().manual_seed(n * 1000 + past + D)
    hq, hkv = 6, 2
    layer = torch.randn(2, 1, hkv, past + n + 5, D, generator=g).bfloat16()
    q = torch.randn(1, n, hq, D, generator=g).bfloat16()
    k, v = torch.randn(2, 1, n, hkv, D, generator=g).bfloat16()
    block = ancestor_matrix(_tree(n, g)) if n > 1 else None
    assert cpu_attention.decode_supports(layer, 1, n)
    sdpa_layer = layer.clone()
    got = cpu_attention.decode_attention(layer, q, k, v, past, block, D ** -0.5)
    ref = _reference(layer, q, past, block, D ** -0.5)
    from specfoundry.runtime.kvcache import MaskBuffer

    with torch.inference_mode():  # (the engine's mask buffer is made and filled in inference mode)
        masks = MaskBuffer(hq // hkv, torch.device("cpu"))
        sdpa = attend(sdpa_layer, q, k, v, past, masks.get(block, 1, n, past), D ** -0.5)
    assert torch.equal(layer, sdpa_layer)  # the new K/V written in the same places
    err, sdpa_err = (got.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
    assert got.shape == sdpa.shape and got.dtype == torch.bfloat16
    assert err <= 8e-3 * ref.abs().max() and err <= sdpa_err + 4e-3 * ref.abs().max()


@pytest.mark.parametrize("n,bw", [(1, 3), (2, 5), (4, 12)])
def test_a_block_over_earlier_drafts_equals_float64(n, bw):
    # a drafting head's tree (the layer kernel's bw > 0): the block [n, bw] covers the last bw columns,
    # earlier drafts included; columns before them are all visible
    import ctypes

    g = torch.Generator().manual_seed(n * 100 + bw)
    hq, hkv, D, past = 4, 2, 64, 30  # past: columns before the new tokens (the earlier drafts among them)
    W = past + n
    layer = torch.randn(2, 1, hkv, W + 2, D, generator=g).bfloat16()
    q = torch.randn(n, hq, D, generator=g).bfloat16()
    block = torch.rand(n, bw, generator=g) < 0.5
    block[:, bw - n:] = torch.eye(n, dtype=torch.bool)  # each new token sees itself, not its siblings
    allow = torch.ones(n, W, dtype=torch.bool)
    allow[:, W - bw:] = block
    K = layer[0, 0, :, :W].double().repeat_interleave(hq // hkv, 0)
    V = layer[1, 0, :, :W].double().repeat_interleave(hq // hkv, 0)
    p = torch.softmax((torch.einsum("nhd,hcd->hnc", q.double(), K) * D ** -0.5).masked_fill(~allow, float("-inf")), -1)
    ref = torch.einsum("hnc,hcd->nhd", p, V)
    out = torch.empty(n, hq, D)
    qf, b8 = q.float().contiguous(), block.to(torch.uint8).contiguous()
    keys, values = layer[0], layer[1]
    i32 = [ctypes.c_int32(v) for v in (past, n, 0)]
    status = cpu_attention._load_decode()[0].sf_attn_rows(
        qf.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1),
        *(ctypes.addressof(v) for v in i32), b8.data_ptr(), bw, 1, hq, hkv, D, D ** -0.5, out.data_ptr(), bw)
    assert status == 0
    assert (out.double() - ref).abs().max() <= 1e-4 * ref.abs().max()  # fp32 sums of exact bf16 inputs


def test_a_chain_tokens_output_is_the_same_bits_alone():
    # a chain verified in one step, then each of its tokens decoded alone over the same columns:
    # masked columns weigh exactly 0 and do not move the sums, so the outputs are equal bit for bit
    g = torch.Generator().manual_seed(5)
    hq, hkv, D, past, n = 9, 3, 64, 50, 5
    layer = torch.randn(2, 1, hkv, past + n + 3, D, generator=g).bfloat16()
    q = torch.randn(1, n, hq, D, generator=g).bfloat16()
    k, v = torch.randn(2, 1, n, hkv, D, generator=g).bfloat16()
    chain = ancestor_matrix(torch.tensor([[-1, 0, 1, 2, 3]]))
    together = cpu_attention.decode_attention(layer, q, k, v, past, chain, D ** -0.5)
    for t in range(n):
        alone = cpu_attention.decode_attention(layer, q[:, t: t + 1], k[:, t: t + 1], v[:, t: t + 1], past + t, None,
                                               D ** -0.5)
        assert torch.equal(alone[0, 0], together[0, t])


def _rows_fp32(layer, q, k, v, past, block, scale):
    """decode_attention's kernel call with its float32 output (before the rounding to the cache dtype)."""
    import ctypes
    n, hq, D = q.shape[1:]
    layer[0, 0, :, past: past + n].copy_(k[0].transpose(0, 1))
    layer[1, 0, :, past: past + n].copy_(v[0].transpose(0, 1))
    out, qf = torch.empty(n, hq, D), q[0].float().contiguous()
    b8 = None if block is None else block.reshape(n, n).to(torch.uint8).contiguous()
    i32 = [ctypes.c_int32(x) for x in (past, n, 0)]
    cpu_attention.check(cpu_attention._load_decode()[0].sf_attn_rows(
        qf.data_ptr(), layer[0].data_ptr(), layer[1].data_ptr(), layer[0].stride(0),
        layer[0].stride(1), *(ctypes.addressof(x) for x in i32), None if b8 is None else b8.data_ptr(), n, 1, hq,
        layer.shape[2], D, scale, out.data_ptr(), 0))
    return out


@pytest.mark.parametrize("past", [16, 29, 50])
def test_a_tree_nodes_output_is_the_same_bits_as_after_the_commit(past):
    # a tree verified in one step (its nodes at slots past.., each seeing its ancestors' slots), then
    # each node's path put in place as the commit does and attended as a chain: the softmax sum runs
    # over the columns in a plain step's order, so every node's float32 output is the same bits
    g = torch.Generator().manual_seed(past)
    hq, hkv, D, n = 9, 3, 64, 8
    layer = (3 * torch.randn(2, 1, hkv, past + n + 16, D, generator=g)).bfloat16()  # peaked scores
    q = (3 * torch.randn(1, n, hq, D, generator=g)).bfloat16()
    k, v = (3 * torch.randn(2, 1, n, hkv, D, generator=g)).bfloat16()
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4, 5]])
    tree = _rows_fp32(layer.clone(), q, k, v, past, ancestor_matrix(parents), D ** -0.5)
    for node in range(n):
        path = [node]
        while parents[0, path[-1]] >= 0:
            path.append(int(parents[0, path[-1]]))
        path = path[::-1]
        chain = _rows_fp32(layer.clone(), q[:, path], k[:, path], v[:, path], past, None, D ** -0.5)
        assert torch.equal(chain[-1], tree[node]), (past, node, path)


@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("n,past,hq,hkv", [(17, 0, 9, 3), (40, 0, 6, 2), (203, 0, 9, 3), (33, 50, 9, 3),
                                           (70, 100, 4, 4), (2, 0, 9, 3)])
def test_prefill_attention_equals_float64_and_is_as_close_as_sdpa(D, n, past, hq, hkv):
    # a prompt's prefill (and a continuation after a cached prefix) over the causal triangle
    from specfoundry.runtime.kvcache import MaskBuffer

    g = torch.Generator().manual_seed(n * 1000 + past + D)
    layer = torch.randn(2, 1, hkv, past + n + 5, D, generator=g).bfloat16()
    q = torch.randn(1, n, hq, D, generator=g).bfloat16()
    k, v = torch.randn(2, 1, n, hkv, D, generator=g).bfloat16()
    assert cpu_attention.prefill_supports(layer, 1, n)
    sdpa_layer = layer.clone()
    got = cpu_attention.prefill_attention(layer, q, k, v, past, D ** -0.5)
    ref = _reference(layer, q, past, None, D ** -0.5)
    with torch.inference_mode():
        masks = MaskBuffer(hq // hkv, torch.device("cpu"))
        causal = torch.ones(1, n, n, dtype=torch.bool).tril()
        sdpa = attend(sdpa_layer, q, k, v, past, masks.get(causal, 1, n, past), D ** -0.5)
    assert torch.equal(layer, sdpa_layer)  # the new K/V written in the same places
    err, sdpa_err = (got.double() - ref).abs().max(), (sdpa.double() - ref).abs().max()
    assert got.shape == sdpa.shape and got.dtype == torch.bfloat16
    assert err <= 8e-3 * ref.abs().max() and err <= sdpa_err + 4e-3 * ref.abs().max()


def test_a_prefill_rows_output_does_not_depend_on_the_tokens_after_it():
    # each part of the query rows scores only up to its last token's column and sums its softmax in
    # one order whatever the part: token t's float32 output is the same bits in a prefill of t + 1
    # tokens as in a prefill of all n (parts split elsewhere, more columns in the buffers)
    import ctypes

    g = torch.Generator().manual_seed(7)
    hq, hkv, D, past, n = 9, 3, 64, 21, 90
    layer = (3 * torch.randn(2, 1, hkv, past + n + 3, D, generator=g)).bfloat16()  # peaked scores
    q = (3 * torch.randn(n, hq, D, generator=g)).float()

    def rows(m):
        out = torch.empty(m, hq, D)
        cpu_attention.check(cpu_attention._load_decode()[0].sf_attn_causal(
            q.data_ptr(), layer[0].data_ptr(), layer[1].data_ptr(), layer[0].stride(1), past, m, hq, hkv, D,
            D ** -0.5, out.data_ptr()))
        return out

    full = rows(n)
    for m in (1, 2, 17, 45, 89):
        assert torch.equal(rows(m)[m - 1], full[m - 1]), m


def test_decode_support_is_refused_outside_its_scope():
    ok = torch.zeros(2, 1, 3, 40, 64, dtype=torch.bfloat16)
    assert cpu_attention.decode_supports(ok, 1, 1) and cpu_attention.decode_supports(ok, 1, cpu_attention.DECODE_MAX_TOKENS)
    assert not cpu_attention.decode_supports(ok, 2, 1)  # batches: the slots' kernel / SDPA
    assert not cpu_attention.decode_supports(ok, 1, cpu_attention.DECODE_MAX_TOKENS + 1)  # prefill: its own call
    assert cpu_attention.prefill_supports(ok, 1, 1000) and not cpu_attention.prefill_supports(ok, 2, 30)
    assert not cpu_attention.decode_supports(ok.float(), 1, 1) and not cpu_attention.prefill_supports(ok.float(), 1, 30)
    odd = torch.zeros(2, 1, 3, 40, 48, dtype=torch.bfloat16)  # D % 32
    assert not cpu_attention.decode_supports(odd, 1, 1) and not cpu_attention.prefill_supports(odd, 1, 30)


def test_engine_forward_takes_it_and_keeps_sdpas_logits(monkeypatch):
    from specfoundry.runtime.tree import tree_depths

    target = tiny_llama(0, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16, init_std=0.02)  # head_dim 32
    target.engine.use_layer_kernel = False  # the op-by-op forward (the layer kernel: test_cpu_layers.py)
    calls = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(1)
    prefix, toks = torch.randint(0, 96, (1, 20), generator=g), torch.randint(0, 96, (1, 7), generator=g)
    parents = _tree(7, g)
    outs = {}
    for lim in (cpu_attention.DECODE_MAX_TOKENS, 0):  # 0: the SDPA path
        monkeypatch.setattr(cpu_attention, "DECODE_MAX_TOKENS", lim)
        cache = target.new_cache(capacity=64)
        target.forward(prefix, cache)
        cache.commit()
        tree = target.forward(toks, cache, position_ids=20 + tree_depths(parents), tree_mask=ancestor_matrix(parents))
        outs[lim] = tree.logits.float()
    assert calls  # the kernel ran for the tree step (not for the 20-token prefill)
    a, b = outs[cpu_attention.DECODE_MAX_TOKENS], outs[0]
    assert (a - b).abs().max() <= 0.03 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.85


def test_engine_prefill_takes_the_causal_kernel_and_keeps_sdpas_logits(monkeypatch):
    from specfoundry.runtime import cpu_layers

    target = tiny_llama(0, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16, init_std=0.02)  # head_dim 32
    calls = []
    # the kernel from rotated Q/K/V, or from the fused product in the layer library's one call (its RoPE too)
    real, fused = cpu_attention.prefill_attention, cpu_layers.prefill_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a: calls.append(a[1].shape[1]) or real(*a))
    monkeypatch.setattr(cpu_layers, "prefill_attention", lambda *a: calls.append(a[1].shape[1]) or fused(*a))
    g = torch.Generator().manual_seed(3)
    prompt, more = torch.randint(0, 96, (1, 60), generator=g), torch.randint(0, 96, (1, 25), generator=g)
    outs = {}
    for kernel in (True, False):  # False: SDPA's causal path
        target.engine.prefill_kernel = kernel
        cache = target.new_cache(capacity=128)
        first = target.forward(prompt, cache).logits.float()
        cache.commit()
        outs[kernel] = torch.cat([first, target.forward(more, cache).logits.float()], 1)  # after a cached prefix
    assert calls == [60, 60, 25, 25]  # both layers, both prefills, only when chosen
    a, b = outs[True], outs[False]
    assert (a - b).abs().max() <= 0.03 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_speculative_greedy_equals_plain_through_the_kernel(monkeypatch):
    # a bf16 target whose head_dim (32) the kernel takes: plain steps and every verification (chains,
    # a tree, prompt-lookup chains) attend through it, and greedy output is the plain output exactly
    target = tiny_llama(0, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16, init_std=0.02)
    target.engine.use_layer_kernel = False
    steps = []
    real = cpu_attention.decode_attention
    monkeypatch.setattr(cpu_attention, "decode_attention", lambda *a: steps.append(a[1].shape[1]) or real(*a))
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}),
                                                ("eagle3", {"depth": 3})], vocab=96)
    assert 1 in steps and max(steps) > 1  # plain steps and verifications both ran on the kernel


@pytest.mark.parametrize("layer_kernel", [False, True], ids=["op-by-op", "layer-kernel"])
def test_chains_and_trees_stay_exact_on_a_peaked_bf16_target(layer_kernel):
    # large-init bf16 weights (peaked logits, big activations: near-ties happen): with the products on
    # the per-row kernel and attention on this one, a chain's tokens and a tree's nodes get a plain
    # step's bits (a node's softmax sum runs over its columns in a plain step's order, though it sits at
    # another cache position than after the commit), so greedy chains (n-gram, EAGLE-3) and EAGLE-3
    # trees of up to 8 nodes (the layer kernel's step) stay exact. Larger trees run the op-by-op
    # forward (PyTorch's SiLU, not the kernel's): there bf16 near-ties are judged by the float32 check
    # (runtime/lossless.py)
    from specfoundry.runtime import cpu_gemv
    from specfoundry.runtime.engine import LlamaEngine

    if not cpu_gemv.bf16_available():
        pytest.skip(f"avx512bf16 matrix kernel unavailable: {cpu_gemv.bf16_unavailable_reason()}")
    # (this target and these prompts: with SDPA instead (DECODE_MAX_TOKENS = 0) the EAGLE-3 chain's
    # output left the plain one at a near-tie, so the test tells the two attentions apart)
    target = tiny_llama(2, vocab=96, hidden=128, layers=2, dtype=torch.bfloat16)  # init std 0.5
    target.engine = LlamaEngine(target.model, kernels=("avx512bf16", "avx512bf16", "avx512bf16"))
    target.engine.use_layer_kernel = layer_kernel  # both forwards: op by op, and all layers in one C call
    assert_greedy_speculation_is_plain(target, [("ngram", {}), ("eagle3", {"tree": "chain", "depth": 3}),
                                                ("eagle3", {"depth": 3, "total_tokens": 8})],
                                       vocab=96, prompts=8, seed=2)
