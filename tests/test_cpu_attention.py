"""The serving batch's CPU decode-attention kernel (runtime/cpu_attention.py): equal to attention
computed in float64 within fp32 / bf16 rounding for rows of any length, token count and tree
block; a token's output the same bits whatever else is in the batch; the slots' forward with it
equal to the SDPA path and to a solo forward."""

import pytest
import torch
import torch.nn.functional as F

from tiny_models import tiny_llama
from specfoundry.runtime import cpu_attention
from specfoundry.runtime.serving import slots as slots_mod
from specfoundry.runtime.serving.slots import SlotCache, forward_slots
from specfoundry.runtime.tree import ancestor_matrix, tree_depths

pytestmark = [pytest.mark.skipif(not cpu_attention.available(), reason=f"attention kernel unavailable: "
                                 f"{cpu_attention.unavailable_reason()}"), pytest.mark.usefixtures("single_thread")]


def reference(q, layer, lens, counts, block, scale):
    """Per row, per head, in float64: softmax(q K^T * scale + mask) V over the row's columns."""
    outs, at = [], 0
    hq, D = q.shape[1:]
    g = hq // layer.shape[2]
    for b, (L, c) in enumerate(zip(lens, counts)):
        qb = q[at: at + c].double().transpose(0, 1)  # [hq, c, D]
        at += c
        K = layer[0, b, :, : L + c].double().repeat_interleave(g, 0)
        V = layer[1, b, :, : L + c].double().repeat_interleave(g, 0)
        m = torch.ones(c, L + c, dtype=torch.bool)
        m[:, L:] = block[b, :c, :c]
        o = F.scaled_dot_product_attention(qb, K, V, attn_mask=m, scale=scale)
        outs.append(o.transpose(0, 1).reshape(c, hq * D))
    return torch.cat(outs)


def case(dtype, D, lens, counts, n, seed=0, hq=9, hkv=3, cap=80):
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    layer = torch.randn(2, B, hkv, cap, D, generator=g).to(dtype)
    block = (torch.rand(B, n, n, generator=g) < 0.5) | torch.eye(n, dtype=torch.bool)
    block &= torch.ones(n, n, dtype=torch.bool).tril()
    q = torch.randn(sum(counts), hq, D, generator=g).to(dtype)
    first = torch.tensor([0] + counts[:-1]).cumsum(0).int()
    return q, layer, torch.tensor(lens, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32), first, block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 24])
def test_kernel_equals_float64_attention(dtype, D):
    # rows with no committed columns, 1-9 columns (shorter than one 8-column block), long ones;
    # one token (plain) up to 5 (a draft tree's nodes under a random ancestor block)
    lens, counts = [0, 7, 30, 1, 61, 3], [1, 4, 2, 3, 1, 5]
    q, layer, L, C, first, block = case(dtype, D, lens, counts, n=5)
    got = cpu_attention.slot_attention(q, layer, L, C, first, block, scale=D ** -0.5)
    want = reference(q, layer, lens, counts, block, D ** -0.5)
    assert got.shape == (sum(counts), 9 * D) and got.dtype == dtype
    # fp32: a few ulps of accumulation; bf16: one rounding of the output (|o| < 4: ulp <= 2^-6)
    tol = 2e-6 if dtype == torch.float32 else 2 ** -6
    assert (got.double() - want).abs().max() <= tol


def test_a_tokens_output_is_the_same_bits_in_any_batch():
    """Each (row, KV head) is computed alone, in the same order: another row in the batch, or more
    of the row's own draft tokens after it, leave a token's output bits unchanged."""
    lens, counts = [12, 40, 5], [3, 1, 4]
    q, layer, L, C, first, block = case(torch.float32, 64, lens, counts, n=4, seed=1)
    together = cpu_attention.slot_attention(q, layer, L, C, first, block, 0.125)
    at = 0
    for b, c in enumerate(counts):
        alone = cpu_attention.slot_attention(q[at: at + c], layer[:, b: b + 1], L[b: b + 1], C[b: b + 1],
                                             torch.zeros(1, dtype=torch.int32), block[b: b + 1], 0.125)
        assert torch.equal(alone, together[at: at + c])
        # the row's first token alone (its later tokens never visible to it: the block is causal)
        first_only = cpu_attention.slot_attention(q[at: at + 1], layer[:, b: b + 1], L[b: b + 1],
                                                  torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                                  block[b: b + 1], 0.125)
        assert torch.equal(first_only, together[at: at + 1])
        at += c


@pytest.mark.skipif(cpu_attention._load_decode()[0] is None, reason="no AVX-512 BF16 rows kernel here")
@pytest.mark.parametrize("D", [64, 128])
def test_the_rows_kernel_gives_a_token_the_same_bits_in_any_batch_grouping_or_thread_count(D):
    """The AVX-512 BF16 kernel splits each (row, KV head)'s query rows into parts by thread count and
    groups them for the P V sums: a token's output bits depend on none of that."""
    lens, counts = [12, 40, 5, 30], [3, 1, 8, 2]
    q, layer, L, C, first, block = case(torch.bfloat16, D, lens, counts, n=8, seed=2)
    assert cpu_attention.rows_kernel(layer)
    together = cpu_attention.slot_attention(q, layer, L, C, first, block, 0.125)
    want = reference(q, layer, lens, counts, block, 0.125)
    assert (together.double() - want).abs().max() <= 0.02 * want.abs().max()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # more, smaller parts per (row, KV head)
        assert torch.equal(cpu_attention.slot_attention(q, layer, L, C, first, block, 0.125), together)
    finally:
        torch.set_num_threads(threads)
    at = 0
    for b, c in enumerate(counts):
        for k in range(1, c + 1):  # the row alone, with only its first k tokens
            alone = cpu_attention.slot_attention(q[at: at + k], layer[:, b: b + 1], L[b: b + 1],
                                                 torch.tensor([k], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                                 block[b: b + 1], 0.125)
            assert torch.equal(alone, together[at: at + k]), (b, k)
        at += c


def test_slot_forward_with_the_kernel_equals_sdpa_and_solo_forwards(monkeypatch):
    """An fp32 tiny Llama: rows of unequal length with trees and plain rows, the kernel path and the
    SDPA-per-range path of forward_slots agree, and each row's logits are its solo forward's."""
    target = tiny_llama(1, vocab=64, layers=2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    lens = [4, 11, 1, 23]
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in lens]
    slots = SlotCache(target._engine(), slots=4, capacity=64)
    assert slots.kernel  # fp32 on a CPU with the kernel: the default path
    for s in seqs:
        cache = target.new_cache()
        target.forward(s.view(1, -1), cache)
        cache.commit()
        slots.add(cache)
    parents = [torch.tensor([-1, 0, 1, 2]), torch.tensor([-1, 0, 0, 1, 2]), torch.tensor([-1]), torch.tensor([-1, 0])]
    N = 5
    tokens, pos = torch.zeros(4, N, dtype=torch.long), torch.zeros(4, N, dtype=torch.long)
    block = torch.eye(N, dtype=torch.bool).repeat(4, 1, 1)
    drafts = []
    for b, p in enumerate(parents):
        n = p.numel()
        drafts.append(torch.randint(0, 64, (n,), generator=gen))
        tokens[b, :n] = drafts[-1]
        pos[b] = lens[b]
        pos[b, :n] += tree_depths(p.view(1, -1))[0]
        block[b, :n, :n] = ancestor_matrix(p.view(1, -1))[0]
    counts = [p.numel() for p in parents]
    monkeypatch.setattr(slots_mod, "KERNEL_TOKENS_PER_ROW", float(N))  # every step on the kernel
    assert slots_mod.uses_kernel(slots, 4, sum(counts))
    out_kernel = forward_slots(slots, tokens, pos, block, counts=counts)
    slots.kernel = False
    out_sdpa = forward_slots(slots, tokens, pos, block, counts=counts)
    for b, p in enumerate(parents):
        n = p.numel()
        torch.testing.assert_close(out_kernel.logits[b, :n], out_sdpa.logits[b, :n], rtol=1e-4, atol=1e-4)  # fp32 rounding through two layers
        ref_cache = target.new_cache()
        target.forward(seqs[b].view(1, -1), ref_cache)
        ref_cache.commit()
        ref = target.forward(drafts[b].view(1, -1), ref_cache, position_ids=lens[b] + tree_depths(p.view(1, -1)),
                             tree_mask=ancestor_matrix(p.view(1, -1)))
        torch.testing.assert_close(out_kernel.logits[b, :n], ref.logits[0], rtol=1e-4, atol=1e-4)  # fp32 rounding through two layers


def test_a_mostly_plain_step_runs_the_kernel_and_equals_sdpa():
    """Under load most rows decode one token and a few draft: such a step (at most
    KERNEL_TOKENS_PER_ROW tokens per row) attends with the kernel by default, equal to SDPA's."""
    target = tiny_llama(3, vocab=64, layers=2, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    lens = [9, 3, 17, 6, 12, 25, 2, 8]
    slots = SlotCache(target._engine(), slots=8, capacity=64)
    for n in lens:
        cache = target.new_cache()
        target.forward(torch.randint(0, 64, (1, n), generator=gen), cache)
        cache.commit()
        slots.add(cache)
    counts = [3] + [1] * 7  # one chain of 2 drafts among plain rows: 10 tokens for 8 rows
    tokens = torch.randint(0, 64, (8, 3), generator=gen)
    pos = torch.tensor(lens).view(8, 1) + torch.arange(3)
    assert slots_mod.uses_kernel(slots, 8, sum(counts)) and not slots_mod.uses_kernel(slots, 8, 8 * 3)
    out_kernel = forward_slots(slots, tokens, pos, None, counts=counts)
    slots.kernel = False
    out_sdpa = forward_slots(slots, tokens, pos, None, counts=counts)
    for b, c in enumerate(counts):
        torch.testing.assert_close(out_kernel.logits[b, :c], out_sdpa.logits[b, :c], rtol=1e-4, atol=1e-4)


def test_unsupported_caches_are_refused():
    layer = torch.zeros(2, 1, 1, 8, 64, dtype=torch.float64)
    assert not cpu_attention.supports(layer)
    assert not cpu_attention.supports(torch.zeros(2, 1, 1, 8, 20))  # head_dim not a multiple of 8
    with pytest.raises(ValueError, match="head_dim"):
        cpu_attention.slot_attention(torch.zeros(1, 1, 64, dtype=torch.float64), layer,
                                     *(torch.zeros(1, dtype=torch.int32),) * 3, torch.ones(1, 1, 1, dtype=torch.bool), 1.0)


def test_serving_greedy_through_the_kernel_equals_the_solo_generator():
    """fp32 tiny Llama, plain decoding under load: every step's attention runs in the kernel, and
    each request's greedy tokens equal the single-sequence generator's (SDPA) token for token."""
    from specfoundry.runtime import SpeculativeGenerator
    from specfoundry.runtime.serving import Request, ServingEngine

    target = tiny_llama(2, vocab=64, layers=2, dtype=torch.float32)
    ps = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 3, 30, 9, 12)]
    want = [SpeculativeGenerator(target, None).generate(prompt_ids=p, max_new_tokens=20, stop_at_eos=False).token_ids
            for p in ps]
    with ServingEngine(target, None, max_batch=4) as eng:
        assert eng.slots.kernel
        handles = [eng.submit(Request(p, max_new_tokens=20, stop_at_eos=False)) for p in ps]
        got = [h.result()[0] for h in handles]
    assert got == want


def test_a_failed_work_buffer_allocation_is_an_error_not_a_wrong_answer():
    # the kernels return a status (1 when a task's score buffer could not be allocated and was
    # skipped); every caller passes it to check(), which raises instead of using the output
    cpu_attention.check(0)
    with pytest.raises(MemoryError, match="score buffer"):
        cpu_attention.check(1)
    lib = cpu_attention._load()[0]
    assert lib.sf_attn_bf16.restype is not None and lib.sf_attn_f32.restype is not None
    rows = cpu_attention._load_decode()[0]
    assert rows is None or rows.sf_attn_rows.restype is not None
