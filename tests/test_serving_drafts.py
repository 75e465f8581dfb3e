"""Batched EAGLE drafting in the serving engine (runtime/serving/drafts.py).

The batched head computes what the per-request drafter computes (same chains, tiny float64
models), costs one head forward per depth for all rows (counted), and keeps serving lossless:
greedy under load equals solo, sampling keeps the target's distribution.
"""

import pytest
import torch

from test_sampling_lossless import PROMPT, STEPS, exact_distribution, goodness_of_fit
from test_serving_engine import prompts, solo
from tiny_models import tiny_llama
from specfoundry.runtime import load_drafter
from specfoundry.runtime.drafters.base import DraftContext
from specfoundry.runtime.sampling import SamplingParams
from specfoundry.runtime.serving import Request, ServingEngine
from specfoundry.runtime.serving.drafts import SlotDrafts

pytestmark = pytest.mark.usefixtures("single_thread")

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(2, vocab=64, layers=2)


def _features(g, n, F, H):
    return torch.randn(1, n, F, H, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_slot_drafts_propose_the_per_request_chains(target, kind):
    """Rows of unequal length, varying accepted counts, depths 1-4, a row leaving (the last row
    moves into its place) and one joining: every batched chain equals the chain the per-request
    drafter proposes from the same pairs."""
    base = load_drafter(kind, target, tree="chain", depth=4)
    F, H = len(base.feature_layers), target.hidden_size
    g = torch.Generator().manual_seed(0)
    slots = SlotDrafts(base.head, slots=4, capacity=256)
    rows: list[dict] = []  # per row: {"ids": [1, L] tokens, "solo": drafter}

    def admit(length):
        ids = torch.randint(0, 64, (1, length), generator=g)
        feats = _features(g, length - 1, F, H)
        solo_d = base.fork()
        solo_d.begin(ids, feats)
        slots.begin(len(rows), ids, feats)
        rows.append({"ids": ids, "solo": solo_d})

    for length in (5, 17, 1, 9):
        admit(length)
    for step in range(12):
        depth = 1 + step % 4
        live = list(range(len(rows)))
        batched = slots.propose(live, [r["ids"][0, -1:] for r in rows], depth, [GREEDY] * len(rows),
                                [None] * len(rows))
        for b, r in enumerate(rows):
            want = r["solo"].propose(DraftContext(r["ids"], GREEDY, depth, depth + 1))
            assert torch.equal(batched[b].tokens, want.tokens), (step, b)
            assert torch.equal(batched[b].parents, want.parents)
            # a verification outcome: some drafts accepted, then a bonus token
            n_acc = int(torch.randint(0, want.num_nodes, (1,), generator=g))
            new = torch.cat([want.tokens[0, 1: n_acc + 1], torch.randint(0, 64, (1,), generator=g)]).view(1, -1)
            feats = _features(g, new.shape[1], F, H)
            r["solo"].commit(new, feats)
            slots.commit(b, new, feats)
            r["ids"] = torch.cat([r["ids"], new], dim=1)
        if step == 5:  # row 1 leaves: the last row moves into it, as in the SlotCache
            last = len(rows) - 1
            slots.remove(1, last)
            rows[1] = rows.pop()
            admit(7)


def test_slot_drafts_cost_one_head_forward_per_depth(target, monkeypatch):
    """Four rows drafting depth 3 in one step: one forward for their queued pairs, two for the
    deeper drafts (the per-request drafter needs four times that)."""
    base = load_drafter("eagle3", target, tree="chain", depth=3)
    F, H = len(base.feature_layers), target.hidden_size
    g = torch.Generator().manual_seed(1)
    slots = SlotDrafts(base.head, slots=4, capacity=128)
    roots = []
    for b, length in enumerate((4, 11, 6, 2)):
        ids = torch.randint(0, 64, (1, length), generator=g)
        slots.begin(b, ids, _features(g, length - 1, F, H))
        slots.commit(b, ids[:, -1:], _features(g, 1, F, H))  # one more verified token each
        roots.append(ids[0, -1:])
    calls = {"n": 0}
    real = base.head.step_rows

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(base.head, "step_rows", counting)
    drafts = slots.propose([0, 1, 2, 3], roots, 3, [GREEDY] * 4, [None] * 4)
    assert calls["n"] == 3
    assert all(d.num_nodes == 4 for d in drafts)


def test_serving_with_slot_drafts_is_lossless_under_load(target):
    """The engine drafts EAGLE-3 chains for all rows at once (forced on, and by the cost model):
    every request's greedy output is its solo output."""
    d = load_drafter("eagle3", target)
    ps = prompts(10)
    want = solo(target, ps)
    for table in ("1-:3", None):
        with ServingEngine(target, d, max_batch=4, max_queue=16, speculation_table=table) as eng:
            assert eng.slot_drafts is not None
            got = [h.result() for h in [eng.submit(Request(p, max_new_tokens=24, stop_at_eos=False)) for p in ps]]
        assert [x[0] for x in got] == want
        if table:
            assert sum(x[2].stats["drafted"] for x in got) > 0  # the slot drafts really drafted


def test_serving_with_slot_drafts_keeps_the_target_distribution():
    """Sampling with a random EAGLE-3 head drafting for 8 rows at once: the first tokens follow the
    target's distribution (chi-square), and the harness rejects the head's own distribution."""
    V = 5
    t = tiny_llama(3, vocab=V, hidden=16, layers=2, init_std=0.3)
    params = SamplingParams(1.0)
    exact = exact_distribution(t, params)
    d = load_drafter("eagle3", t, architecture={"draft_vocab_size": V})
    n = 1500
    counts = {}
    with ServingEngine(t, d, max_batch=8, max_queue=n, speculation_table="1-:2") as eng:
        assert eng.slot_drafts is not None
        hs = [eng.submit(Request(PROMPT, max_new_tokens=STEPS, temperature=1.0, seed=7000 + i, stop_at_eos=False))
              for i in range(n)]
        got = [h.result() for h in hs]
    assert sum(x[2].stats["drafted"] for x in got) > 0
    for ids, _, _ in got:
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
    p, tv = goodness_of_fit(exact, counts, n)
    assert p > 1e-3, (p, tv)
    # the harness can fail: a distribution that is not the target's is rejected
    flat = {k: 1.0 / len(exact) for k in exact}
    p_wrong, _ = goodness_of_fit(flat, counts, n)
    assert p_wrong < 1e-3
