"""Adaptive speculation: the expected-token formula and the draft shapes (depth and node count)
it chooses from acceptance and a cost curve."""

import pytest

from specfoundry.runtime.adaptive import AdaptiveController, clean_cost_curve, expected_tokens, leviathan_tokens


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_expected_tokens_matches_leviathan_for_constant_acceptance(a, k):
    assert expected_tokens([a] * k, k) == pytest.approx(leviathan_tokens(a, k))
    assert leviathan_tokens(1.0, k) == k + 1


def _run(ctrl: AdaptiveController, accept_prob: float, steps: int, verify_s, draft_s_per_depth: float):
    """Simulate steps with deterministic acceptance pattern and a cost model; return choices."""
    choices = []
    chains = [(k, k + 1) for k in range(1, ctrl.max_depth + 1)]
    for i in range(steps):
        shape = ctrl.choose(chains)
        k = shape[0]
        choices.append(k)
        # accepted count: expected fraction, deterministic
        accepted = int(k * accept_prob + 0.5) if accept_prob < 1 else k
        ctrl.record(shape, k, accepted, k + 1, verify_s(k + 1), draft_s_per_depth * k)
    return choices


def test_high_acceptance_cheap_draft_uses_full_depth():
    ctrl = AdaptiveController(max_depth=5)
    choices = _run(ctrl, 1.0, 40, lambda n: 0.040 + 0.002 * n, 0.001)
    assert choices[0] == 0  # the first step measures plain cost
    assert all(c == 5 for c in choices[-20:])


def test_useless_drafts_fall_back_to_plain_but_keep_probing():
    ctrl = AdaptiveController(max_depth=5, probe_every=8)
    choices = _run(ctrl, 0.0, 80, lambda n: 0.040 + 0.004 * n, 0.010)
    tail = choices[-40:]
    assert tail.count(0) >= 30, tail
    assert any(c > 0 for c in tail), "must probe speculation now and then"


def test_expensive_verify_prefers_short_drafts():
    ctrl = AdaptiveController(max_depth=6)
    # acceptance around 0.5, each extra verified token costs as much as a plain step
    choices = _run(ctrl, 0.5, 60, lambda n: 0.040 * n, 0.0)
    assert max(choices[-20:]) <= 2


def test_disabled_controller_always_uses_max_depth():
    ctrl = AdaptiveController(max_depth=3, enabled=False)
    assert _run(ctrl, 0.0, 10, lambda n: 1.0, 1.0) == [3] * 10


def _simulate_shapes(curve: dict[int, float], a: float, steps: int = 120, draft_s: float = 0.001):
    """An environment where a (k, n) draft yields the tokens of the controller's own tree model
    at true acceptance ``a`` and an n-node forward costs ``0.03 * curve(n)`` seconds."""
    shapes = [(k, n) for k in range(1, 6) for n in sorted({k + 1, 4, 8, 16}) if n >= k + 1]
    shapes.remove((5, 16))
    shapes.append((5, 16))
    ctrl = AdaptiveController(max_depth=5, cost_curve=curve)
    ref = AdaptiveController(max_depth=5, cost_curve=curve, prior_acceptance=a, prior_strength=1e9)
    choices = []
    for _ in range(steps):
        k, n = shape = ctrl.choose(shapes)
        choices.append(shape)
        accepted = round(ref.tokens(shape)) - 1 if k else 0
        ctrl.record(shape, k, accepted, n, 0.03 * ctrl._curve(n) if curve else 0.03 * n, draft_s * k)
    return choices


def test_flat_cost_curve_picks_big_trees():
    # verification of up to 16 nodes costs what one token does (a memory-bound forward)
    curve = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.6}
    tail = _simulate_shapes(curve, a=0.5)[-30:]
    assert sum(n >= 8 for _, n in tail) >= 25, tail


def test_steep_cost_curve_picks_chains_or_small_trees():
    # every node costs as much as a plain step (compute-bound): wide trees never pay
    curve = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}
    tail = _simulate_shapes(curve, a=0.7)[-30:]
    assert all(n <= 4 for _, n in tail), tail


def test_curve_fills_in_sizes_not_yet_measured():
    ctrl = AdaptiveController(max_depth=3, cost_curve={1: 1.0, 4: 1.2, 16: 2.0})
    ctrl.record((0, 1), 0, 0, 1, 0.050, 0.0)
    assert ctrl.verify_seconds(4) == pytest.approx(0.060)
    assert ctrl.verify_seconds(10) == pytest.approx(0.050 * 1.6)
    assert ctrl.verify_seconds(32) == pytest.approx(0.050 * (2.0 + 0.8 / 12 * 16))


def test_generator_offers_chains_and_tree_budgets_with_the_fixed_shape_last():
    from types import SimpleNamespace

    from specfoundry.runtime import SpeculativeGenerator

    protocol = {m: (lambda *a: None) for m in ("begin", "propose", "commit")}  # a drafter's methods, unused
    tree = SimpleNamespace(default_depth=3, default_nodes=16, **protocol)
    shapes = SpeculativeGenerator(None, tree)._shapes(3)
    assert shapes[-1] == (3, 16) and len(set(shapes)) == len(shapes)
    assert {(1, 2), (2, 3), (3, 4), (1, 8), (2, 16)} <= set(shapes)
    chain = SimpleNamespace(default_depth=4, default_nodes=5, **protocol)
    assert SpeculativeGenerator(None, chain)._shapes(4) == [(1, 2), (2, 3), (3, 4), (4, 5)]


def test_a_new_request_probes_speculation_even_when_plain_was_winning():
    ctrl = AdaptiveController(max_depth=3, probe_every=8)
    chains = [(1, 2), (2, 3), (3, 4)]
    for _ in range(30):  # useless drafts: the controller settles on plain decoding
        shape = ctrl.choose(chains)
        ctrl.record(shape, shape[0], 0, shape[0] + 1, 0.04 * (shape[0] + 1), 0.01 * shape[0])
    assert ctrl.choose(chains) == (0, 1)
    ctrl.new_request()
    assert ctrl.choose(chains)[0] > 0


def test_acceptance_follows_the_current_prompt_not_all_earlier_ones():
    """A controller kept across requests: after 200 steps where every draft was accepted, a prompt
    where nothing is accepted turns it to plain decoding within a few dozen steps (with cumulative
    counts the earlier steps kept it speculating for hundreds)."""
    ctrl = AdaptiveController(max_depth=4, probe_every=8)
    cost = lambda n: 0.020 + 0.001 * n  # noqa: E731
    _run(ctrl, 1.0, 200, cost, 0.002)
    assert ctrl.acceptance()[0] > 0.9
    later = _run(ctrl, 0.0, 80, cost, 0.002)
    assert later[:10].count(0) < 10  # it does not switch on the first miss
    assert later[-40:].count(0) >= 30, later
    with pytest.raises(ValueError, match="decay"):
        AdaptiveController(max_depth=2, decay=0.0)


def test_trees_whose_siblings_never_help_are_discounted_and_chains_win():
    """Siblings that are never accepted (the second-best child never matches): a tree yields what
    the chain of its depth yields. After running some trees the measured ratio pulls every tree
    shape's estimate down, including the tree shapes not run yet, and the controller settles on
    chains even though the verification cost curve is flat enough to tempt it into trees."""
    curve = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.6}
    shapes = [(k, n) for k in range(1, 5) for n in sorted({k + 1, 4, 8, 16}) if n >= k + 1]
    shapes.remove((4, 16))
    shapes.append((4, 16))
    ctrl = AdaptiveController(max_depth=4, cost_curve=curve)
    chain_model = AdaptiveController(max_depth=4, prior_acceptance=0.4, prior_strength=1e9)
    choices = []
    for _ in range(200):
        k, n = shape = ctrl.choose(shapes)
        choices.append(shape)
        accepted = round(chain_model.tokens((k, k + 1))) - 1 if k else 0  # the chain's tokens, whatever n is
        ctrl.record(shape, k, accepted, n, 0.03 * ctrl._curve(n), 0.0005 * k)
    trees_run = {s for s in choices if s[1] > s[0] + 1}
    assert trees_run, "the model should have tried some trees first"
    unmeasured = [s for s in shapes if s[1] > s[0] + 1 and s not in trees_run]
    assert all(ctrl.calibration(s) < 0.9 for s in trees_run | set(unmeasured))
    tail = choices[-40:]
    assert sum(n == k + 1 or k == 0 for k, n in tail) >= 36, tail


def test_a_measured_cost_curve_is_made_non_decreasing():
    """Dips are pooled with their neighbours (a least-squares monotone fit); a monotone curve and
    its sizes are kept as measured; bad points are dropped."""
    assert clean_cost_curve({1: 1.0, 2: 0.93, 4: 1.06, 8: 1.04, 16: 1.21}) == pytest.approx(
        {1: 0.965, 2: 0.965, 4: 1.05, 8: 1.05, 16: 1.21})
    assert clean_cost_curve({16: 2.0, 1: 1.0, 4: 1.2}) == {1: 1.0, 4: 1.2, 16: 2.0}
    assert clean_cost_curve({1: 1.0, 2: 0.5, 3: 0.6, 4: 2.0}) == pytest.approx({1: 0.7, 2: 0.7, 3: 0.7, 4: 2.0})
    assert clean_cost_curve({1: 1.0, 4: float("nan"), 8: -2.0, 0: 1.0, 16: 3.0}) == {1: 1.0, 16: 3.0}
    assert clean_cost_curve(None) == {} and clean_cost_curve({}) == {}
    assert AdaptiveController(3, cost_curve={1: 1.0, 2: 0.9}).cost_curve == pytest.approx({1: 0.95, 2: 0.95})
