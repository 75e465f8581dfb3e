"""The serving engine: slot cache, batched lossless speculative decoding, load-aware policy.

Tiny float64 Llamas (exact); the HTTP server on top is tested in test_server.py.
"""

import random
import threading
import time

import pytest
import torch

from test_sampling_lossless import PROMPT, STEPS, exact_distribution, goodness_of_fit
from tiny_models import perturbed_copy, tiny_llama
from specfoundry.runtime import SpeculativeGenerator, load_drafter
from specfoundry.runtime.drafters.draft import DraftModelDrafter
from specfoundry.runtime.drafters.lookup import LookupFirstDrafter
from specfoundry.runtime.drafters.ngram import NgramDrafter
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.serving import slots as slots_module
from specfoundry.runtime.serving.slots import row_groups
from specfoundry.runtime.serving import (AcceptanceMonitor, QueueFull, Request, ServingEngine, SlotCache,
                                         SpeculationPolicy, forward_slots, parse_table)
from specfoundry.runtime.tree import ancestor_matrix, tree_depths

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def target():
    return tiny_llama(1, vocab=64, layers=2)


def prompts(n=8, lengths=(5, 9, 3, 17, 1, 12, 7, 30)):
    return [[int(x) for x in torch.randint(0, 64, (lengths[i % len(lengths)],), generator=torch.Generator().manual_seed(i))]
            for i in range(n)]


def solo(target, ps, max_new_tokens=24):
    g = SpeculativeGenerator(target, None)
    return [g.generate(prompt_ids=p, max_new_tokens=max_new_tokens, stop_at_eos=False).token_ids for p in ps]


def prefilled_slots(target, lens, gen):
    """A SlotCache whose rows hold random sequences of ``lens`` tokens (each prefilled on its own
    cache, then taken into a row)."""
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in lens]
    slots = SlotCache(target._engine(), slots=4, capacity=64)
    for s in seqs:
        cache = target.new_cache()
        target.forward(s.view(1, -1), cache)
        cache.commit()
        slots.add(cache)
    return slots, seqs


def test_row_groups_split_where_reading_padded_columns_costs_more_than_a_call():
    assert row_groups([10, 10, 10], overhead=160) == [(0, 3, 1, 11)]
    # one long row among short ones gets its own range; the short ones share one
    assert row_groups([50, 1100, 60, 40], overhead=160) == [(0, 1, 1, 51), (1, 2, 1, 1101), (2, 4, 1, 61)]
    assert row_groups([50, 1100, 60, 40], overhead=10**6) == [(0, 4, 1, 1101)]
    assert row_groups([5, 9, 7], overhead=0) == [(0, 1, 1, 6), (1, 2, 1, 10), (2, 3, 1, 8)]
    assert row_groups([]) == []
    # one long draft among one-token rows of one length gets its own range (padding every row to 6
    # queries cost more than two more calls); a uniform batch stays one range
    lens = [300] * 32
    assert row_groups(lens, [1] * 5 + [6] + [1] * 26) == [(0, 5, 1, 301), (5, 6, 6, 306), (6, 32, 1, 301)]
    assert row_groups(lens, [2] * 32) == [(0, 32, 2, 302)]
    assert row_groups([300, 300], [1, 6], overhead=10**6) == [(0, 2, 6, 306)]
    for lens, counts in (([3], None), ([7, 200, 7, 200, 7], [1, 3, 1, 1, 5]), (list(range(1, 40)), None)):
        g = row_groups(lens, counts)  # ranges cover every row once, in order
        counts = counts or [1] * len(lens)
        assert [s for s, _, _, _ in g] == [0] + [e for _, e, _, _ in g[:-1]] and g[-1][1] == len(lens)
        assert all(m == max(counts[s:e]) and w == max(lens[s:e]) + m for s, e, m, w in g)


@pytest.mark.parametrize("overhead,packed", [(None, False), (0, False), (None, True)])  # 0: a range per row
def test_slot_forward_matches_solo_forwards_with_unequal_lengths_and_trees(target, overhead, packed, monkeypatch):
    """Rows of different committed lengths, each with its own tree: one batched forward gives each
    row the logits a solo forward of that row gives; committing random accepted paths and running a
    second step still matches a fresh solo computation of the committed sequences. ``packed``: the
    padding is named (``counts``), so only the real nodes run through the linears and the LM head;
    the padding then holds other ids, and every real row's logits must still be its solo ones."""
    if overhead is not None:
        monkeypatch.setattr(slots_module, "GROUP_OVERHEAD_COLUMNS", overhead)
    gen = torch.Generator().manual_seed(0)
    lens = [4, 11, 1]
    slots, seqs = prefilled_slots(target, lens, gen)
    # trees: a chain of 3, a 5-node tree, root only (padded to 5 nodes)
    parents = [torch.tensor([-1, 0, 1, 2]), torch.tensor([-1, 0, 0, 1, 2]), torch.tensor([-1])]
    N = 5
    tokens = torch.zeros(3, N, dtype=torch.long)
    pos = torch.zeros(3, N, dtype=torch.long)
    block = torch.eye(N, dtype=torch.bool).repeat(3, 1, 1)
    drafts = []
    for b, p in enumerate(parents):
        n = p.numel()
        t = torch.randint(0, 64, (n,), generator=gen)
        drafts.append(t)
        tokens[b, :n] = t
        pos[b] = lens[b]
        pos[b, :n] += tree_depths(p.view(1, -1))[0]
        block[b, :n, :n] = ancestor_matrix(p.view(1, -1))[0]
    counts = [p.numel() for p in parents] if packed else None
    if packed:  # padding that would change the result if it were computed with the real rows
        for b, p in enumerate(parents):
            tokens[b, p.numel():] = 63
    out = forward_slots(slots, tokens, pos, block, counts=counts)
    for b, p in enumerate(parents):
        n = p.numel()
        ref_cache = target.new_cache()
        target.forward(seqs[b].view(1, -1), ref_cache)
        ref_cache.commit()
        ref = target.forward(drafts[b].view(1, -1), ref_cache, position_ids=(lens[b] + tree_depths(p.view(1, -1))),
                             tree_mask=ancestor_matrix(p.view(1, -1)))
        torch.testing.assert_close(out.logits[b, :n], ref.logits[0], rtol=1e-9, atol=1e-9)
    keeps = [torch.tensor([0, 1, 2]), torch.tensor([0, 2, 4]), torch.tensor([0])]  # row 1: a non-contiguous path
    slots.commit(keeps)
    assert slots.lengths[:3] == [lens[0] + 3, lens[1] + 3, lens[2] + 1]
    committed = [torch.cat([seqs[b], drafts[b][keeps[b]]]) for b in range(3)]
    nxt = torch.randint(0, 64, (3, 1), generator=gen)
    out2 = forward_slots(slots, nxt, torch.tensor(slots.lengths[:3]).view(3, 1))
    for b in range(3):
        ref = target.forward(torch.cat([committed[b], nxt[b]]).view(1, -1), target.new_cache())
        torch.testing.assert_close(out2.logits[b, 0], ref.logits[0, -1], rtol=1e-9, atol=1e-9)
    # a row leaving: the last row moves into its place and keeps its entries
    slots.commit([torch.tensor([0])] * 3)
    assert slots.remove(0) == 2 and slots.active == 2
    out3 = forward_slots(slots, nxt[[2, 1]], torch.tensor(slots.lengths[:2]).view(2, 1))
    ref = target.forward(torch.cat([committed[2], nxt[2], nxt[2]]).view(1, -1), target.new_cache())
    torch.testing.assert_close(out3.logits[0, 0], ref.logits[0, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("decode_rows", [2, 0])
def test_mixed_forward_runs_prefill_chunks_beside_decode_rows(target, decode_rows):
    """Chunked prefill: decode rows (trees) and prompt chunks of two requests in one forward give
    the decode rows their solo logits, and each request's chunks (1, 3 and 6 tokens, continued over
    two forwards) the features, KV and last-token logits of a solo prefill of the whole prompt."""
    engine = target._engine()
    gen = torch.Generator().manual_seed(3)
    lens = [6, 13][:decode_rows]
    slots, seqs = prefilled_slots(target, lens, gen)
    par = torch.tensor([[-1, 0, 0]])
    tokens = torch.randint(0, 64, (decode_rows, 3), generator=gen)
    pos = torch.tensor(lens, dtype=torch.long).view(-1, 1) + tree_depths(par)
    block = ancestor_matrix(par).expand(decode_rows, 3, 3)
    prompts_ = [torch.randint(0, 64, (n,), generator=gen) for n in (4, 9)]
    caches = [engine.new_cache(capacity=2) for _ in prompts_]  # grows as chunks arrive
    feats, last = [[], []], [None, None]
    for cuts in ([(0, 1), (0, 3)], [(1, 4), (3, 9)]):
        chunks = [(caches[j], prompts_[j][a:b]) for j, (a, b) in enumerate(cuts)]
        out, fs = slots_module.forward_mixed(slots, tokens[:, :1] if cuts[0][0] else tokens,
                                             pos[:, :1] if cuts[0][0] else pos, None if cuts[0][0] else block,
                                             chunks, feature_layers=(1, 2))
        for j, (lg, f) in enumerate(fs):
            feats[j].append(f)
            last[j] = lg
        if decode_rows and not cuts[0][0]:
            for b in range(decode_rows):
                ref_cache = target.new_cache()
                target.forward(seqs[b].view(1, -1), ref_cache)
                ref_cache.commit()
                ref = target.forward(tokens[b].view(1, -1), ref_cache, position_ids=pos[b].view(1, -1),
                                     tree_mask=ancestor_matrix(par))
                torch.testing.assert_close(out.logits[b], ref.logits[0], rtol=1e-9, atol=1e-9)
            slots.commit([torch.tensor([0])] * decode_rows)
        elif not decode_rows:
            assert out is None
    for j, p in enumerate(prompts_):
        ref_cache = target.new_cache()
        ref = target.forward(p.view(1, -1), ref_cache, feature_layers=(1, 2))
        ref_cache.commit()
        assert caches[j].length == p.numel()
        torch.testing.assert_close(torch.cat(feats[j], dim=1), ref.features, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(last[j], ref.logits[0, -1], rtol=1e-9, atol=1e-9)  # the first token's logits
        torch.testing.assert_close(caches[j].kv[:, :, :, :, : p.numel()], ref_cache.kv[:, :, :, :, : p.numel()],
                                   rtol=1e-9, atol=1e-9)


def test_prefill_chunks_of_a_bf16_target_attend_on_the_causal_kernel(monkeypatch):
    """A bf16 target (head_dim 32): each request's prompt chunks (a first chunk, then one after its
    cached prefix) attend on the engine's causal prefill kernel, as a solo prefill does, and give a solo
    prefill's last-token logits and K/V within bf16 rounding (the products' row counts differ)."""
    from specfoundry.runtime import cpu_attention

    if not cpu_attention.prefill_supports(torch.zeros(2, 1, 2, 8, 32, dtype=torch.bfloat16), 1, 2):
        pytest.skip(f"the AVX-512 BF16 attention kernel is unavailable: {cpu_attention._load_decode()[1]}")
    target = tiny_llama(4, vocab=64, hidden=128, layers=2, dtype=torch.bfloat16, init_std=0.02)
    engine = target._engine()
    calls = []
    real = cpu_attention.prefill_attention
    monkeypatch.setattr(cpu_attention, "prefill_attention", lambda *a: calls.append(a[4]) or real(*a))
    gen = torch.Generator().manual_seed(5)
    prompts_ = [torch.randint(0, 64, (n,), generator=gen) for n in (21, 40)]
    slots = SlotCache(engine, slots=2, capacity=64)
    caches = [engine.new_cache(capacity=2) for _ in prompts_]
    last = [None, None]
    for cuts in ([(0, 9), (0, 17)], [(9, 21), (17, 40)]):
        chunks = [(caches[j], prompts_[j][a:b]) for j, (a, b) in enumerate(cuts)]
        _, fs = slots_module.forward_mixed(slots, torch.zeros(0, 1, dtype=torch.long),
                                           torch.zeros(0, 1, dtype=torch.long), None, chunks)
        last = [lg.float() for lg, _ in fs]
    assert sorted(set(calls)) == [0, 9, 17]  # the first chunks (past 0) and the later ones (after their prefix)
    for j, p in enumerate(prompts_):
        ref_cache = target.new_cache()
        ref = target.forward(p.view(1, -1), ref_cache).logits[0, -1].float()
        assert (last[j] - ref).abs().max() <= 0.03 * ref.abs().max()
        got_kv, ref_kv = caches[j].kv[..., : p.numel(), :].float(), ref_cache.kv[..., : p.numel(), :].float()
        assert (got_kv - ref_kv).abs().max() <= 0.03 * ref_kv.abs().max()


def _serving_drafter(target, drafter):
    if drafter == "draft":
        return DraftModelDrafter(perturbed_copy(target, 0.02), depth=4)
    if drafter == "eagle3+lookup":  # batched head rows and lookup rows in the same steps
        return LookupFirstDrafter(load_drafter("eagle3", target, tree="chain", depth=3), min_match=1)
    return load_drafter(drafter, target) if drafter else None


def _count_lookups(monkeypatch) -> list:
    """Counts lookups that found a continuation (so a test sees the lookup path really ran)."""
    found, real = [], NgramDrafter.lookup

    def lookup(self, k):
        out = real(self, k)
        found.extend([1] if out else [])
        return out

    monkeypatch.setattr(NgramDrafter, "lookup", lookup)
    return found


@pytest.mark.parametrize("drafter", ["draft", "eagle3", "eagle3+lookup", "medusa", "ngram", None])
def test_batched_greedy_equals_solo_under_load(target, drafter, monkeypatch):
    """More requests than slots, submitted from several threads, speculation forced on (table) or
    chosen by the cost model: every request's greedy output is its solo output (with the eagle3
    drafter, each row attends in its own column range too)."""
    if drafter == "eagle3":
        monkeypatch.setattr(slots_module, "GROUP_OVERHEAD_COLUMNS", 0)
    found = _count_lookups(monkeypatch)
    d = _serving_drafter(target, drafter)
    ps = prompts(10)
    want = solo(target, ps)
    for table in ("1-:3", None):
        with ServingEngine(target, d, max_batch=4, max_queue=16, speculation_table=table) as eng:
            handles = [None] * len(ps)

            def submit(i):
                handles[i] = eng.submit(Request(ps[i], max_new_tokens=24, stop_at_eos=False))

            threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(ps))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got = [h.result() for h in handles]
        assert [g[0] for g in got] == want
        assert all(g[2].finish_reason == "length" for g in got)
        if drafter == "draft" and table:
            assert sum(g[2].stats["accepted"] for g in got) > 0  # speculation really ran
        if drafter == "eagle3+lookup" and table:
            assert eng.slot_drafts is not None and found  # both sources drafted


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3+lookup", "ngram", None])
def test_chunked_prefill_under_load_equals_solo(target, drafter, capsys):
    """Prompts prefilled a few tokens per step beside the decoding rows (max_step_tokens=6): every
    request's greedy output is still its solo output, and a request cancelled while its prompt is
    being prefilled ends "cancelled" without disturbing the others."""
    d = _serving_drafter(target, drafter)
    ps = prompts(8)
    want = solo(target, ps)
    with ServingEngine(target, d, max_batch=3, max_queue=16, speculation_table="1-:2", max_step_tokens=6) as eng:
        handles = [eng.submit(Request(p, max_new_tokens=24, stop_at_eos=False)) for p in ps]
        doomed = eng.submit(Request([5] * 40, max_new_tokens=8, stop_at_eos=False))
        doomed.cancel()
        got = [h.result() for h in handles]
        assert doomed.result()[2].finish_reason == "cancelled"
        for _ in range(500):  # the engine thread frees the last row right after its final event
            if eng.load()["running"] == 0:
                break
            time.sleep(0.01)
        assert eng.load()["running"] == 0
    assert [g[0] for g in got] == want
    assert "drafter failed" not in capsys.readouterr().err  # e.g. a one-token prompt's row has no head output yet


def test_batched_sampling_keeps_the_target_distribution():
    """Sampling under batching (8 requests in flight, drafts forced on): the distribution of a
    request's first tokens is the target's (chi-square), and the same harness rejects a wrong one."""
    V = 5
    t = tiny_llama(3, vocab=V, hidden=16, layers=2, init_std=0.3)
    params = SamplingParams(1.0)
    exact = exact_distribution(t, params)
    d = DraftModelDrafter(perturbed_copy(t, 0.5), depth=3)
    n = 1500
    counts = {}
    with ServingEngine(t, d, max_batch=8, max_queue=n, speculation_table="1-:2") as eng:
        hs = [eng.submit(Request(PROMPT, max_new_tokens=STEPS, temperature=1.0, seed=5000 + i, stop_at_eos=False))
              for i in range(n)]
        for h in hs:
            key = tuple(h.result()[0])
            counts[key] = counts.get(key, 0) + 1
    p, tv = goodness_of_fit(exact, counts, n)
    assert p > 1e-3, (p, tv)
    # the check can fail: the draft model's own distribution is not the target's
    wrong = exact_distribution(d.lm, params)
    p_wrong, _ = goodness_of_fit({k: v for k, v in wrong.items()}, {k: c for k, c in counts.items() if wrong.get(k, 0) > 0}, n)
    assert p_wrong < 1e-3


def test_cancel_queue_bound_and_validation(target):
    eng = ServingEngine(target, None, max_batch=1, max_queue=1)
    try:
        long = eng.submit(Request(prompts(1)[0], max_new_tokens=400, stop_at_eos=False))
        waiting = eng.submit(Request([1, 2], max_new_tokens=3, stop_at_eos=False))
        with pytest.raises(QueueFull):
            for _ in range(3):
                eng.submit(Request([1, 2], max_new_tokens=3))
        long.cancel()
        ids, _, last = long.result()
        assert last.finish_reason == "cancelled" and len(ids) < 400
        assert waiting.result()[2].finish_reason == "length"  # the freed slot served the next request
        for bad, msg in [(Request([]), "non-empty"), (Request([64]), "0..63"), (Request([1], max_new_tokens=0), ">= 1"),
                         (Request([1], temperature=float("nan")), "temperature"), (Request([1], top_p=0.0), "top_p"),
                         (Request([1], top_k=0), "top_k"), (Request([1], max_new_tokens=10_000), "context")]:
            with pytest.raises(ValueError, match=msg):
                eng.submit(bad)
    finally:
        eng.close()


def test_engine_runs_on_the_thread_its_owner_gives_it(target):
    """background=False: no thread of the engine's own; the owner's run() serves what other threads
    submit (each request exactly its solo greedy output), close() from another thread ends run(),
    and run() is refused twice and on a background engine."""
    ps = prompts(6)
    want = solo(target, ps, 12)
    eng = ServingEngine(target, None, max_batch=3, max_queue=8, background=False)
    got, ran_on = {}, []

    def client(i):
        got[i] = eng.submit(Request(ps[i], max_new_tokens=12, stop_at_eos=False)).result()[0]

    def clients():
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        eng.close()

    before = threading.active_count()
    helper = threading.Thread(target=clients)
    helper.start()
    orig = eng._step
    eng._step = lambda q: (ran_on.append(threading.current_thread()), orig(q))
    eng.run()  # returns once close() is called
    helper.join()
    assert [got[i] for i in range(len(ps))] == want
    assert ran_on and set(ran_on) == {threading.current_thread()}
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="already"):
        eng.run()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(Request(ps[0], max_new_tokens=2))
    bg = ServingEngine(target, None, max_batch=1)
    with pytest.raises(RuntimeError, match="background"):
        bg.run()
    bg.close()


def test_policy_turns_speculation_off_as_load_grows():
    """Fake cost model: flat up to 8 rows, then linear (a CPU's compute-bound region). With 70%
    acceptance, batch 1 drafts deep, batch 16 does not draft at all."""
    policy = SpeculationPolicy(4, cost=lambda rows: max(1.0, rows / 8))
    policy.prior = lambda: [0.75] * 4  # server-wide acceptance 0.75 at every depth
    mons = [policy.monitor() for _ in range(16)]
    assert policy.choose(mons[:1]) == [4]  # 5 rows cost what 1 does
    assert policy.choose(mons[:2]) == [3, 3]  # 2 x 4 rows still do; 2 x 5 would not
    assert policy.choose(mons) == [0] * 16
    # an occasional depth-1 probe keeps the estimates current under load, on two rows at a time,
    # taken in turn (every row of a large batch probing made each catch its head up on its prompt)
    choices = [policy.choose(mons) for _ in range(2 * policy.probe_every)]
    probes = [c for c in choices if any(c)]
    assert len(probes) == 2 and all(sorted(set(c)) == [0, 1] and sum(c) == 2 for c in probes)
    assert [b for b, k in enumerate(probes[0]) if k] == [0, 1] and [b for b, k in enumerate(probes[1]) if k] == [2, 3]
    depths = [policy.best_depth(mons[:b]) for b in (1, 2, 4, 8, 16)]
    assert depths == sorted(depths, reverse=True)  # never deeper under more load
    # a table overrides the cost model; opted-out requests never draft
    table = SpeculationPolicy(4, cost=lambda r: 1.0, table="1-2:3,3-:1")
    off = table.monitor(speculate=False)
    assert table.choose([table.monitor(), off]) == [3, 0]
    assert table.choose([table.monitor() for _ in range(5)]) == [1] * 5


def test_policy_prices_a_small_trees_rows():
    """A request whose head drafts a tree at full depth (monitor.tree_nodes) pays that tree's rows
    in the cost model: with the fake cost above, one request drafts the 8-node tree (8 rows cost
    what 1 does), two requests step back to chains of 3 (2 x 8 rows would cost 2 units)."""
    policy = SpeculationPolicy(4, cost=lambda rows: max(1.0, rows / 8))
    policy.prior = policy.tree_prior = lambda: [0.75] * 4
    assert policy.best_depth([policy.monitor(tree_nodes=8)]) == 4
    assert policy.best_depth([policy.monitor(tree_nodes=8) for _ in range(2)]) == 3
    assert policy.best_depth([policy.monitor() for _ in range(2)]) == 3  # chains: 2 x 4 rows
    wide = [policy.monitor(tree_nodes=40)]
    assert policy.best_depth(wide) == 3 and wide[0].rows(4) == 40 and wide[0].rows(3) == 4
    # a lookup chain replacing a tree frees the tree's rows
    assert policy.take_lookups([policy.monitor(tree_nodes=40)], [4], [4]) == [True]


def test_policy_reads_a_dip_in_the_measured_cost_curve_as_noise():
    """Figures measured in one serving run on a noisy 2-core machine (bf16, 1 client): the startup
    curve had 2 rows cheaper than 1, which priced a chain of 1 (2 rows) below the head's 4-node tree
    and made the policy draft chains of 1 where the tree gives more tokens per second (measured
    steps: 64.5 ms for the chain, 70.9 ms for the tree). Pooled, the dip is gone and the tree wins."""
    curve = {1: 1.0, 2: 0.93, 4: 1.06, 8: 1.04, 16: 1.21, 32: 1.48, 64: 1.5}
    policy = SpeculationPolicy(2, cost=curve)
    assert policy.cost(1) <= policy.cost(2) <= policy.cost(4) <= policy.cost(8) <= policy.cost(16)
    policy.unit, policy.draft = 0.0723, 0.00566
    policy.prior, policy.tree_prior = (lambda: [0.28, 0.5]), (lambda: [0.42, 0.28])
    assert policy.best_depth([policy.monitor(tree_nodes=4)]) == 2
    raw = SpeculationPolicy(2, cost=lambda rows: curve[rows])  # the curve as measured
    raw.unit, raw.draft, raw.prior, raw.tree_prior = policy.unit, policy.draft, policy.prior, policy.tree_prior
    assert raw.best_depth([raw.monitor(tree_nodes=4)]) == 1


def test_policy_fits_drafting_as_a_fixed_part_plus_a_part_per_token():
    """Drafting that costs 3 ms per step plus 2 ms per drafted token is learnt as such from the
    steps' measured seconds (not 3.5-5 ms per token), so a step 2 deep is priced at 7 ms, not twice
    a step 1 deep; one depth alone cannot be split and is charged per token; the fit never goes
    negative."""
    policy = SpeculationPolicy(3, cost=lambda rows: 1.0)
    for i in range(200):
        k = 1 + i % 2
        policy.record_step(0.05, k + 1, 0.003 + 0.002 * k, k)
    assert policy.draft == pytest.approx(0.002) and policy.draft_fixed == pytest.approx(0.003)
    assert policy.seconds(3, 2) == pytest.approx(0.05 + 0.007) and policy.seconds(1, 0) == pytest.approx(0.05)
    one = SpeculationPolicy(3, cost=lambda rows: 1.0)
    for _ in range(50):
        one.record_step(0.05, 3, 0.008, 2)
    assert one.draft == pytest.approx(0.004) and one.draft_fixed == 0.0
    noisy = SpeculationPolicy(3, cost=lambda rows: 1.0)
    for i in range(100):  # deeper steps measured cheaper: no negative price for depth
        k = 1 + i % 2
        noisy.record_step(0.05, k + 1, 0.006 - 0.001 * k, k)
    assert noisy.draft == 0.0 and noisy.draft_fixed == pytest.approx(0.0045, rel=0.05)
    # batches: drafting 8 rows costs the fixed part once per step
    batch = SpeculationPolicy(3, cost=lambda rows: 1.0)
    for i in range(200):
        x = (1 + i % 2) * (1 + i % 8)
        batch.record_step(0.05, x + 1, 0.004 + 0.001 * x, x)
    assert batch.draft == pytest.approx(0.001) and batch.draft_fixed == pytest.approx(0.004)


def test_policy_charges_each_step_its_measured_overhead():
    """A step's seconds outside drafting and verification (streaming its tokens, the loop) are paid
    once per step: a near-tie between a chain of 1 (1.28 tokens in 55 ms) and a 4-node tree 2 deep
    (1.54 tokens in 70 ms) goes to the chain without it and to the tree with 30 ms a step. The
    overhead is an average of the measured gaps; a negative reading is ignored."""
    def policy_with(overhead):
        p = SpeculationPolicy(2, cost=lambda rows: 1.0 if rows <= 2 else 1.2)
        p.unit, p.draft = 0.05, 0.005
        p.prior, p.tree_prior = (lambda: [0.28, 0.5]), (lambda: [0.54, 0.0])
        for _ in range(50):
            p.record_overhead(overhead)
        p.record_overhead(-1.0)
        return p
    fast = policy_with(0.0)
    assert fast.best_depth([fast.monitor(tree_nodes=4)]) == 1
    slow = policy_with(0.03)
    assert slow.overhead == pytest.approx(0.03)
    assert slow.best_depth([slow.monitor(tree_nodes=4)]) == 2
    assert slow.seconds(1, 0) == pytest.approx(0.05 + 0.03)


def test_policy_prices_plain_steps_and_steps_with_drafts_apart():
    """A plain step's attention may run in one kernel call, a step with drafts by SDPA per range of
    rows: the two kinds are measured apart. At 16 rows, one lookup chain of 3 (1.875 expected tokens
    for 3 more rows, within the flat part of the cost curve) pays at the shared unit and not when
    steps with drafts measure 0.08 s against plain steps' 0.05 s."""
    policy = SpeculationPolicy(3, cost=lambda rows: max(1.0, rows / 24))
    policy.prior = lambda: [0.05] * 3  # the head accepts nothing: depth 0
    mons = [policy.monitor() for _ in range(16)]
    policy.unit = 0.05
    assert policy.best_depth(mons) == 0
    assert policy.take_lookups(mons, [0] * 16, [3] + [0] * 15) == [True] + [False] * 15  # one unit for all
    for _ in range(30):
        policy.record_step(0.05, 16, 0.0, 0, 16)
        policy.record_step(0.08, 18, 0.0, 0, 16)
    assert policy.units[False] == pytest.approx(0.05) and policy.units[True] == pytest.approx(0.08)
    assert policy.take_lookups(mons, [0] * 16, [3] + [0] * 15) == [False] * 16
    assert policy.seconds(16, 0, 16) == pytest.approx(0.05) and policy.seconds(18, 0, 16) == pytest.approx(0.08)
    # where the serving forward attends mostly plain steps with the kernel too (up to 1.5 rows per
    # sequence), such a step is of the plain kind: the lookup pays again; a step past it does not
    policy.plain_rows = 1.5
    assert policy.seconds(24, 0, 16) == pytest.approx(0.05 * policy.cost(24)) and policy.kind(25, 16)
    assert policy.take_lookups(mons, [0] * 16, [3] + [0] * 15) == [True] + [False] * 15


def test_policy_measures_plain_steps_at_a_batch_size_before_pricing_drafts_against_them():
    """Units are kept per range of batch sizes. Where only steps with drafts were measured at a
    batch size (under load every step had taken lookups, the plain price a guess from small
    batches), the next step is plain (no depth, no lookups); once measured, lookups are priced
    against the measured plain steps and declined when those are cheaper per token."""
    policy = SpeculationPolicy(3, cost=lambda rows: max(1.0, rows / 24))
    policy.prior = lambda: [0.05] * 3
    policy.lookup_acceptance = lambda: [0.6] * 3
    for _ in range(20):
        policy.record_step(0.05, 4, 0.0, 0, 4)  # plain steps at 4 sequences: 50 ms a unit
        policy.record_step(0.12 * policy.cost(56), 56, 0.0, 0, 32)  # steps with lookups at 32: 120 ms a unit
    assert policy.unit_of(False, 4) == pytest.approx(0.05) and policy.unit_of(True, 32) == pytest.approx(0.12)
    mons = [policy.monitor() for _ in range(32)]
    assert policy.plain_unmeasured(32) and not policy.plain_unmeasured(4)
    assert policy.choose(mons) == [0] * 32
    assert policy.take_lookups(mons, [0] * 32, [3] * 32) == [False] * 32
    policy.record_step(0.09 * policy.cost(32), 32, 0.0, 0, 32)  # the plain step: 90 ms a unit at 32
    assert not policy.plain_unmeasured(32) and policy.unit_of(False, 32) == pytest.approx(0.09)
    assert policy.unit_of(False, 4) == pytest.approx(0.05)  # other batch sizes keep their own
    taken = policy.take_lookups(mons, [0] * 32, [3] * 32)
    # up to 48 rows (1.0 rows per sequence here: any lookup makes the slower kind at 120 ms): none pays
    assert taken == [False] * 32
    # a size with neither kind measured falls back to the kinds over all sizes
    assert policy.unit_of(False, 200) == policy.units[False]


def test_policy_speculates_only_past_its_margin():
    """A depth or a step's lookups are taken only when their expected rate beats not speculating by
    the margin: at 32 rows on a flat cost, one lookup chain of 1 (+0.5 tokens, 1.6%) is declined,
    eight of them (+12.5%) are taken; with the margin at 0 the single one is taken too."""
    policy = SpeculationPolicy(3, cost=lambda rows: 1.0)
    policy.prior = lambda: [0.05] * 3
    policy.unit = 0.05
    mons = [policy.monitor() for _ in range(32)]
    assert policy.margin == pytest.approx(0.05)
    assert policy.take_lookups(mons, [0] * 32, [1] + [0] * 31) == [False] * 32
    assert policy.take_lookups(mons, [0] * 32, [1] * 8 + [0] * 24) == [True] * 8 + [False] * 24
    policy.margin = 0.0
    assert policy.take_lookups(mons, [0] * 32, [1] + [0] * 31) == [True] + [False] * 31
    # the head: a 1-row batch whose depth 1 gains 4% (1.04 tokens for the same seconds) stays plain
    head = SpeculationPolicy(1, cost=lambda rows: 1.0)
    head.unit, head.prior = 0.05, (lambda: [0.04])
    assert head.best_depth([head.monitor()]) == 0
    head.prior = lambda: [0.2]
    assert head.best_depth([head.monitor()]) == 1


def test_engine_prices_steps_by_the_attention_they_run(target):
    """The engine tells the policy up to how many rows per sequence its forward attends a step
    with the CPU kernel (the plain kind), or 1.0 when the kernel does not run."""
    from specfoundry.runtime.serving import slots as slots_mod
    with ServingEngine(target, _serving_drafter(target, "ngram"), max_batch=2) as eng:
        want = slots_mod.KERNEL_TOKENS_PER_ROW if eng.slots.kernel else 1.0
        assert eng.policy.plain_rows == want
        assert slots_mod.uses_kernel(eng.slots, 2, 3) == (eng.slots.kernel and 3 <= 2 * slots_mod.KERNEL_TOKENS_PER_ROW)


def test_engine_measures_the_overhead_between_decode_steps(target, monkeypatch):
    """The engine feeds the policy the gap between one decode step's end of verification and the
    next step's start, never across an admission (a prefill is not per-step overhead)."""
    gaps = []
    real = SpeculationPolicy.record_overhead
    monkeypatch.setattr(SpeculationPolicy, "record_overhead", lambda self, s: (gaps.append(s), real(self, s)))
    ps = prompts(3)
    with ServingEngine(target, _serving_drafter(target, "ngram"), max_batch=1, max_queue=4) as eng:
        got = [h.result() for h in [eng.submit(Request(p, max_new_tokens=12, stop_at_eos=False)) for p in ps]]
        steps, overhead = eng.steps, eng.policy.overhead
    assert [g[0] for g in got] == solo(target, ps, 12)
    # one request at a time: every step but each request's first decode step is measured
    assert 0 < len(gaps) <= steps - len(ps) and all(g >= 0 for g in gaps) and overhead > 0


def test_lookup_drafts_are_taken_where_they_pay_and_kept_apart():
    """Fake cost model: flat up to 8 rows, then growing (at 16 rows an extra row costs 1/24 of the
    step): a lookup chain rides on a small batch whatever the head's depth
    (even 0, or a request whose monitor has the head off), is taken under load only when the
    lookup drafts accept well, and its steps never move the head's acceptance figures."""
    cost = lambda rows: max(1.0, 0.5 + rows / 16)  # noqa: E731
    policy = SpeculationPolicy(5, cost=cost)
    policy.prior = lambda: [0.2] * 5  # a head that does not pay: depth 0 for every batch
    policy.draft = 0.5  # seconds per head-drafted token (lookup drafts cost none)
    mons = [policy.monitor() for _ in range(16)]
    assert policy.choose(mons[:1]) == [0]
    assert policy.take_lookups(mons[:1], [0], [5]) == [True]  # 6 rows cost what 1 does
    assert policy.take_lookups(mons[:2], [0, 0], [0, 3]) == [False, True]  # no match: nothing to take
    mons[0].switch_off()
    assert policy.take_lookups(mons[:1], [0], [4]) == [True]
    # 16 rows: extra rows cost; lookups that never accept do not pay, ones that always do (93% after
    # the pooled figures' smoothing) do, for some rows
    for _ in range(50):
        policy.record_lookup(5, 0)
    low = policy.take_lookups(mons, [0] * 16, [5] * 16)
    assert policy.lookup_acceptance()[0] == pytest.approx(4 / 58) and not any(low)  # 0/50 behind 8 pseudo-steps at 0.5
    fresh = SpeculationPolicy(5, cost=cost)
    fresh.prior, fresh.draft = policy.prior, policy.draft
    for _ in range(50):
        fresh.record_lookup(5, 5)
    high = fresh.take_lookups(mons, [0] * 16, [5] * 16)
    assert any(high) and fresh.lookup_acceptance() == [pytest.approx(54 / 58)] * 5
    # the head's pooled figures saw none of it
    assert sum(policy.pooled.tried) == 0 and sum(fresh.pooled.tried) == 0


def test_monitor_switches_a_request_off_and_reprobes():
    policy = SpeculationPolicy(3, cost={1: 1.0, 2: 1.3, 4: 1.9}, window=8, reprobe=5, min_steps=4)
    m = policy.monitor()
    for _ in range(4):
        assert m.speculating
        policy.record(m, 3, 0)  # nothing accepted
    assert not m.speculating and m.turned_off == 1
    assert policy.choose([m]) == [0]
    for _ in range(5):
        policy.record(m, 0, 0)  # plain steps count down to the re-probe
    assert m.speculating
    good = policy.monitor()
    for _ in range(8):
        policy.record(good, 3, 3)
    assert good.speculating and policy.best_depth([good]) == 3


def test_monitor_acceptance_follows_its_window():
    """The monitor keeps its window's tallies between steps: after any records (the window
    evicting its oldest steps, tree and chain steps, a switch-off) its acceptance equals one
    computed afresh from the same steps."""
    rng = random.Random(0)
    m = AcceptanceMonitor(4, window=5, tree_nodes=8)
    prior = [0.5, 0.4, 0.3, 0.2]

    def fresh(tree):
        f = AcceptanceMonitor(4, window=5, tree_nodes=8)
        for d, a in (m.tree_steps if tree else m.steps):
            f.record(d, a, tree)
        return f.acceptance(prior, tree=tree)

    for i in range(60):
        d = rng.randint(0, 4)
        m.record(d, rng.randint(0, d), tree=rng.random() < 0.3)
        if i == 40:
            m.switch_off()
        for tree in (False, True):
            assert m.acceptance(prior, tree=tree) == fresh(tree)
    assert len(m.steps) == 5 and m.turned_off == 1


def test_speculation_table_parser():
    assert parse_table("1-4:3,5-8:1,9-:0", 4) == [(1, 4, 3), (5, 8, 1), (9, 1 << 30, 0)]
    assert parse_table("1:2", 4) == [(1, 1, 2)]
    for bad in ("1-4", "a-b:1", "4-1:1", "1-:9", "0-3:1"):
        with pytest.raises(ValueError, match="speculation table"):
            parse_table(bad, 4)


def test_monitor_acceptance_starts_at_the_prior():
    m = AcceptanceMonitor(2)
    assert m.acceptance([0.3, 0.2]) == [0.3, 0.2]
    for _ in range(100):
        m.record(2, 2)
    # only the last 16 steps count, shrunk towards the prior with the weight of 4
    assert m.acceptance([0.3, 0.2]) == pytest.approx([(16 + 4 * 0.3) / 20, (16 + 4 * 0.2) / 20])


def test_one_failing_request_does_not_stop_the_others(target, monkeypatch):
    """A drafter that raises: that request goes on plainly (same output); a verification that
    raises: that request ends with "error", the others finish normally and the engine keeps serving."""
    ps = prompts(4)
    want = solo(target, ps)
    d = DraftModelDrafter(perturbed_copy(target, 0.02), depth=3)
    with ServingEngine(target, d, max_batch=4, speculation_table="1-:2") as eng:
        bad = eng.drafter.fork()
        calls = {"n": 0}

        def broken_propose(ctx):
            calls["n"] += 1
            raise RuntimeError("planted drafter failure")

        real_fork = eng.drafter.fork
        forks = iter([bad])
        monkeypatch.setattr(eng.drafter, "fork", lambda: next(forks, None) or real_fork())
        monkeypatch.setattr(bad, "propose", broken_propose)
        hs = [eng.submit(Request(p, max_new_tokens=24, stop_at_eos=False)) for p in ps]
        got = [h.result() for h in hs]
        assert calls["n"] >= 1 and [g[0] for g in got] == want

        import specfoundry.runtime.serving.scheduler as sched
        real_verify = sched.verify

        def verify_failing_at_t05(draft, logits, sampling, gen):
            if sampling.temperature == 0.5:  # the planted failure hits one request only
                raise RuntimeError("planted verify failure")
            return real_verify(draft, logits, sampling, gen)

        monkeypatch.setattr(sched, "verify", verify_failing_at_t05)
        h_bad = eng.submit(Request(ps[0], max_new_tokens=24, temperature=0.5, stop_at_eos=False, seed=1))
        h_ok = eng.submit(Request(ps[1], max_new_tokens=24, stop_at_eos=False))
        ids, _, last = h_bad.result()
        assert last.finish_reason == "error" and "planted verify failure" in last.error and ids == []
        assert h_ok.result()[0] == want[1]
        monkeypatch.setattr(sched, "verify", real_verify)
        assert eng.generate(Request(ps[2], max_new_tokens=24, stop_at_eos=False))[0] == want[2]


def test_one_rejected_first_draft_does_not_turn_the_server_plain():
    """The pooled figures start from pseudo-steps at 50%: a server whose first draft was rejected
    at the first position still drafts for a new request where drafting is free (read as 0%
    acceptance, it stayed plain until the next probe: measured at 1 client, tau 1.2 vs 1.6)."""
    policy = SpeculationPolicy(3, cost=lambda rows: 1.0)
    policy.record(policy.monitor(), 3, 0)
    assert 0.4 < policy.prior()[0] < 0.5
    assert policy.best_depth([policy.monitor()]) == 3
    for _ in range(200):  # many rejections do settle it
        policy.record(policy.monitor(), 3, 0)
    assert policy.prior()[0] < 0.05


def test_tree_and_chain_steps_are_tallied_apart():
    """A request whose chains accept poorly but whose tree accepts well keeps drafting its tree
    (one tally for both let the chains' figures stand for the tree, which was then never tried);
    the pooled figures are kept apart the same way."""
    policy = SpeculationPolicy(3, cost=lambda rows: max(1.0, rows / 8))
    policy.draft = 0.05  # seconds per head-drafted depth, against 1 s per cost unit
    m = policy.monitor(tree_nodes=8)
    for _ in range(12):
        policy.record(m, 1, 0)  # chains of 1: rejected
        policy.record(m, 3, 2, tree=True)  # trees 3 deep: two accepted
    chain, tree = policy.estimates([m])[0]
    assert chain[0] < 0.3 and tree[0] > 0.8 and tree[1] > 0.8
    assert policy.pooled.tried[1] == 12 and policy.pooled_tree.tried[1] == 12
    assert m.speculating and policy.best_depth([m]) == 3
    chains_only = policy.monitor()  # the same figures without a tree: not worth drafting
    for _ in range(12):
        policy.record(chains_only, 1, 0)
    assert policy.best_depth([chains_only]) < 3


def test_engine_returns_freed_memory_when_idle_and_every_few_seconds_under_load(target, monkeypatch):
    """glibc keeps the blocks of the steps' ever-changing tensor sizes: the engine thread trims
    them when it goes idle and every TRIM_SECONDS under load (the soak's RSS, docs/results.md)."""
    from specfoundry.runtime import native
    from specfoundry.runtime.serving import scheduler

    assert native.release_free_memory() in (True, False)  # glibc: True; elsewhere a no-op
    calls = []
    monkeypatch.setattr(scheduler, "release_free_memory", lambda: calls.append(time.monotonic()))
    monkeypatch.setattr(scheduler, "TRIM_SECONDS", 0.0)  # every loop: counts one per step
    with ServingEngine(target, None, max_batch=2) as eng:
        ids, _, _ = eng.generate(Request(prompts(1)[0], max_new_tokens=6, stop_at_eos=False))
        assert len(ids) == 6
        # six steps (prefill + 5 decodes); the trim after the last step may still be running when
        # the last token arrives, so only the five before it are certain
        assert len(calls) >= 5
    monkeypatch.setattr(scheduler, "TRIM_SECONDS", 3600.0)  # under load never; idle once at the end
    calls.clear()
    with ServingEngine(target, None, max_batch=2) as eng:
        eng.generate(Request(prompts(1)[0], max_new_tokens=6, stop_at_eos=False))
        time.sleep(0.2)
        assert len(calls) == 1
