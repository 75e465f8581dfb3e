"""One definition of tau and acceptance by position (runtime/tau.py), shared by every harness."""

import pytest

from tiny_models import perturbed_copy, tiny_llama
from specfoundry.runtime import SpeculativeGenerator
from specfoundry.runtime.drafters.draft import DraftModelDrafter
from specfoundry.runtime.tau import summarize_tau


def test_tau_is_pooled_and_acceptance_comes_from_pooled_counts():
    recs = [{"new_tokens": 10, "target_forwards": 10, "tried": [10, 0], "passed": [0, 0]},   # tau 1.0
            {"new_tokens": 90, "target_forwards": 30, "tried": [30, 30], "passed": [30, 30]},  # tau 3.0
            {"new_tokens": 0, "target_forwards": 0}]  # nothing decoded: not a request that counts
    s = summarize_tau(recs)
    assert s["tau"] == pytest.approx(100 / 40)  # not the mean of per-request ratios (2.0)
    assert (s["n"], s["tau_min"], s["tau_median"], s["tau_max"]) == (2, 1.0, 2.0, 3.0)
    assert s["tried"] == [40, 30] and s["passed"] == [30, 30]
    assert s["acceptance_by_position"] == [0.75, 1.0]
    assert summarize_tau([])["tau"] is None


def test_generation_stats_carry_the_counts_behind_their_acceptance():
    t = tiny_llama(2, vocab=64, layers=2)
    gen = SpeculativeGenerator(t, DraftModelDrafter(perturbed_copy(t, 0.02), depth=3), adaptive=False)
    outs = [gen.generate(prompt_ids=[1, 2, 3 + i], max_new_tokens=20, stop_at_eos=False) for i in range(3)]
    for o in outs:
        assert o.stats.acceptance_by_position == [p / t if t else 0.0 for p, t in zip(o.stats.passed, o.stats.tried)]
        assert o.stats.tried[0] == o.stats.speculative_steps
    s = summarize_tau([o.stats for o in outs])
    assert s["tau"] == pytest.approx(sum(o.stats.new_tokens for o in outs) / sum(o.stats.target_forwards for o in outs))
