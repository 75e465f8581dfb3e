"""Speculative sampling preserves the target's distribution, end to end through the generator.

A tiny-vocabulary Llama target; the exact distribution of its first 3 sampled tokens is
enumerated from its own processed probabilities (temperature / top-k / top-p). Thousands of
speculative generations (seed i) are compared with it by a chi-square test and a TV bound,
for chains and trees. The same test rejects a generator with a planted wrong acceptance rule.
"""

import itertools
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tiny_models import perturbed_copy, tiny_llama
from specfoundry.runtime import SpeculativeGenerator, available_drafters, load_drafter, probs_from_logits
from specfoundry.runtime import generator as generator_mod
from specfoundry.runtime.drafters.draft import DraftModelDrafter
from specfoundry.runtime.sampling import SamplingParams, sample
from specfoundry.runtime.verify import VerifyResult

pytestmark = pytest.mark.usefixtures("single_thread")

V, STEPS = 5, 3
PROMPT = [1, 3, 2]


@pytest.fixture(scope="module")
def small_target():
    return tiny_llama(3, vocab=V, hidden=16, layers=2, init_std=0.3)


def exact_distribution(target, params: SamplingParams) -> dict[tuple, float]:
    dist = {}
    for seq in itertools.product(range(V), repeat=STEPS):
        ids = torch.tensor([PROMPT + list(seq)])
        logits = target.model(ids).logits[0, len(PROMPT) - 1 : -1]
        probs = probs_from_logits(logits, params)
        dist[seq] = float(torch.prod(probs[torch.arange(STEPS), torch.tensor(seq)]))
    return dist


def sampled_counts(gen, params: SamplingParams, n: int, stream: str = "") -> dict[tuple, int]:
    """Outcomes of ``n`` generations with seeds ``base + i``; each case names its own ``stream``
    (base = crc32 of it) so that no two cases share random numbers."""
    counts = {}
    base = zlib.crc32(stream.encode()) % 10**6 * 10**4
    for i in range(n):
        out = gen.generate(prompt_ids=PROMPT, max_new_tokens=STEPS, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=base + i, stop_at_eos=False)
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def goodness_of_fit(exact: dict, counts: dict, n: int) -> tuple[float, float]:
    """(chi-square p-value over cells with expected count >= 5 plus one pooled cell, TV distance)."""
    assert set(counts) <= {k for k, p in exact.items() if p > 0}, "sampled a sequence the target cannot produce"
    big = [k for k, p in exact.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [exact[k] * n for k in big]
    rest_exp = n - sum(exp)
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    p_value = chisquare(np.array(obs, float), np.array(exp, float)).pvalue
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    return p_value, tv


N = 2000


def _cases(target):
    cases = [
        ("draft-chain T=1", DraftModelDrafter(perturbed_copy(target, 0.3), target), dict(max_depth=2),
         SamplingParams(1.0)),
        ("draft-chain T=0.7 top-p 0.9", DraftModelDrafter(tiny_llama(9, vocab=V, hidden=16, layers=2, init_std=0.3), target),
         dict(max_depth=3), SamplingParams(0.7, top_p=0.9)),
        ("ngram deterministic T=1.3 top-k 4", load_drafter("ngram", target=target), dict(max_depth=2),
         SamplingParams(1.3, top_k=4)),
        # no drafter: every step is a plain step (verify's one-draw path)
        ("plain T=0.9 top-p 0.9", None, {}, SamplingParams(0.9, top_p=0.9)),
    ]
    if "eagle3" in available_drafters():
        cases.append(("eagle3 dynamic tree T=1", load_drafter("eagle3", target=target, top_k=2, depth=2,
                                                                  sampled_trees=True),
                      dict(max_depth=2, max_nodes=7), SamplingParams(1.0)))
        # a tree shape asked to sample drafts a chain of its depth (sampled_trees=False, the default)
        cases.append(("eagle3 tree shape drafting chains T=1", load_drafter("eagle3", target=target, top_k=2, depth=2),
                      dict(max_depth=2, max_nodes=7), SamplingParams(1.0)))
        # the head runs only the prompt's last pair of two (prompt_window): other drafts, the same distribution
        cases.append(("eagle3 chain, prompt window 1 T=1", load_drafter("eagle3", target=target, tree="chain", depth=2,
                                                                        prompt_window=1),
                      dict(max_depth=2, max_nodes=3), SamplingParams(1.0)))
        # one-hot lookup chains when the last token occurred before, sampled head chains otherwise
        from specfoundry.runtime.drafters.lookup import LookupFirstDrafter

        cases.append(("eagle3 chain, lookup first T=1",
                      LookupFirstDrafter(load_drafter("eagle3", target=target, tree="chain", depth=2), min_match=1,
                                         lookup_depth=2), dict(max_depth=2, max_nodes=3), SamplingParams(1.0)))
        # a measured runtime shape may be a small fixed tree behind lookup (runtime/tune.py: tree@K/N)
        from specfoundry.runtime.adaptive import tree_options

        cases.append(("eagle3 small tree, lookup first T=1",
                      LookupFirstDrafter(load_drafter("eagle3", target=target, **tree_options(2, 4), sampled_trees=True), min_match=1,
                                         lookup_depth=2), dict(max_depth=2, max_nodes=4), SamplingParams(1.0)))
        # a reduced, permuted draft vocabulary: drafts are drawn over it and q mapped into the target's
        from specfoundry.runtime.drafters.eagle import Eagle3Drafter
        from specfoundry.runtime.speculators import Eagle3Head

        head = Eagle3Head.from_target(target, draft_token_ids=[4, 1, 3])
        cases.append(("eagle3 reduced vocab T=1", Eagle3Drafter(head, top_k=2, depth=2, sampled_trees=True),
                      dict(max_depth=2, max_nodes=6), SamplingParams(1.0)))
        # drafts drawn at a multiple of the request's temperature (runtime/calibrate.py), verified against
        # the q they were drawn from (the C chain at 0.6 x: tests/test_cpu_layers.py)
        cases.append(("eagle3 sampled tree draft temperature 1.5 T=0.8 top-p 0.9",
                      load_drafter("eagle3", target=target, top_k=2, depth=2, sampled_trees=True, draft_temperature=1.5),
                      dict(max_depth=2, max_nodes=6), SamplingParams(0.8, top_p=0.9)))
        # the chain fast path (one draw per depth, no tree search) over the reduced vocabulary
        cases.append(("eagle3 chain reduced vocab T=0.8 top-p 0.9", Eagle3Drafter(head, tree="chain", depth=2),
                      dict(max_depth=2, max_nodes=3), SamplingParams(0.8, top_p=0.9)))
    if "medusa" in available_drafters():
        cases.append(("medusa static tree T=0.8 top-p 0.95", load_drafter("medusa", target=target),
                      dict(max_depth=2, max_nodes=6), SamplingParams(0.8, top_p=0.95)))
        # reduced, permuted draft vocabulary: q over the draft ids scattered into the target's
        from specfoundry.runtime.drafters.medusa import MedusaDrafter
        from specfoundry.runtime.speculators import MedusaHeads

        heads = MedusaHeads.from_target(target, num_heads=2, draft_token_ids=[4, 1, 3])
        cases.append(("medusa reduced vocab T=1", MedusaDrafter(heads, choices=[[0], [1], [0, 0], [0, 1], [1, 0]]),
                      dict(max_depth=2, max_nodes=6),
                      SamplingParams(1.0)))
    return cases


CASE_NAMES = ["draft-chain T=1", "draft-chain T=0.7 top-p 0.9", "ngram deterministic T=1.3 top-k 4", "plain T=0.9 top-p 0.9",
              "eagle3 dynamic tree T=1", "eagle3 tree shape drafting chains T=1", "eagle3 chain, prompt window 1 T=1",
              "eagle3 chain, lookup first T=1", "eagle3 small tree, lookup first T=1",
              "eagle3 reduced vocab T=1",
              "eagle3 sampled tree draft temperature 1.5 T=0.8 top-p 0.9",
              "eagle3 chain reduced vocab T=0.8 top-p 0.9", "medusa static tree T=0.8 top-p 0.95",
              "medusa reduced vocab T=1"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_speculative_sampling_matches_target_distribution(small_target, case):
    cases = {label: rest for label, *rest in _cases(small_target)}
    assert case in cases, f"{case} is not available (drafter not registered)"
    drafter, opts, params = cases[case]
    exact = exact_distribution(small_target, params)
    gen = SpeculativeGenerator(small_target, drafter, adaptive=False, **opts)
    counts = sampled_counts(gen, params, N, case)
    p_value, tv = goodness_of_fit(exact, counts, N)
    print(f"{case}: chi-square p={p_value:.3g}, TV={tv:.3f}")
    assert p_value > 1e-3 and tv < 0.08, (p_value, tv)


def _always_accept_verify(draft, target_logits, sampling, generator=None):
    """A planted non-lossless rule: accept every draft along the first chain, then sample."""
    B, N_ = draft.tokens.shape
    chain = [0]
    while True:
        kids = (draft.parents[0] == chain[-1]).nonzero().flatten()
        if len(kids) == 0:
            break
        chain.append(int(kids[0]))
    probs = probs_from_logits(target_logits[:, chain[-1]], sampling)
    return VerifyResult(torch.tensor([len(chain) - 1]), torch.tensor([chain]), sample(probs, generator))


def test_distribution_test_has_power(small_target, monkeypatch):
    params = SamplingParams(1.0)
    exact = exact_distribution(small_target, params)
    drafter = DraftModelDrafter(tiny_llama(9, vocab=V, hidden=16, layers=2, init_std=0.3), small_target)
    monkeypatch.setattr(generator_mod, "verify", _always_accept_verify)
    gen = SpeculativeGenerator(small_target, drafter, adaptive=False, max_depth=2)
    counts = sampled_counts(gen, params, 600)
    p_value, tv = goodness_of_fit(exact, counts, 600)
    assert p_value < 1e-6 and tv > 0.1, (p_value, tv)


def test_sampling_requests_draft_chains_unless_sampled_trees(small_target):
    """A tree-shaped EAGLE drafter drafts a chain of the tree's depth for a sampling request (a
    sampled tree drafts and verifies in Python: slower than plain decoding on the CPU), a tree for
    a greedy one; ``sampled_trees=True`` keeps the sampled tree (the distribution test above)."""
    from specfoundry.runtime.drafters.base import DraftContext

    if "eagle3" not in available_drafters():
        pytest.skip("no eagle3 drafter")
    prompt = torch.tensor([[1, 2, 3, 4, 0]])
    shapes = {}
    for sampled_trees in (False, True):
        d = load_drafter("eagle3", target=small_target, top_k=3, depth=3, total_tokens=8, sampled_trees=sampled_trees)
        cache = small_target.new_cache(capacity=64)
        out = small_target.forward(prompt[:, :-1], cache, feature_layers=d.feature_layers)
        d.begin(prompt, out.features)
        for T in (0.0, 1.0):
            draft = d.propose(DraftContext(prompt, SamplingParams(T), 3, 8, torch.Generator().manual_seed(0)))
            shapes[sampled_trees, T] = draft.parents[0].tolist()
    assert shapes[False, 1.0] == [-1, 0, 1, 2]  # a chain of depth 3
    assert len(shapes[False, 0.0]) == 8 and shapes[False, 0.0] == shapes[True, 0.0]  # greedy: the tree
    assert len(shapes[True, 1.0]) == 8 and shapes[True, 1.0] != [-1, 0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="sampled_trees"):
        load_drafter("eagle3", target=small_target, sampled_trees="yes")
