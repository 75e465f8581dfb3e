"""Adaptive speculation: the expected-token formula and the depth choices it drives."""

import pytest

from specfoundry.runtime.adaptive import AdaptiveController, expected_tokens, leviathan_tokens


@pytest.mark.parametrize("a", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_expected_tokens_matches_leviathan_for_constant_acceptance(a, k):
    assert expected_tokens([a] * k, k) == pytest.approx(leviathan_tokens(a, k))
    assert leviathan_tokens(1.0, k) == k + 1


def _run(ctrl: AdaptiveController, accept_prob: float, steps: int, verify_s, draft_s_per_depth: float):
    """Simulate steps with deterministic acceptance pattern and a cost model; return choices."""
    choices = []
    for i in range(steps):
        k = ctrl.choose(lambda d: d + 1)
        choices.append(k)
        # accepted count: expected fraction, deterministic
        accepted = int(k * accept_prob + 0.5) if accept_prob < 1 else k
        ctrl.record(k, accepted, k + 1, verify_s(k + 1), draft_s_per_depth * k)
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
