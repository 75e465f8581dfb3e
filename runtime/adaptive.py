"""Adaptive speculation: pick the draft depth that maximises expected tokens per second.

Tracks, per draft depth d, the conditional acceptance a_d = P(depth d accepted | depth d-1
accepted) and the measured costs (draft time per depth, verify time per forward size). The
expected tokens of a depth-k step are ``1 + sum_j prod_{i<=j} a_i`` (for a constant ``a`` this
is Leviathan et al.'s ``(1 - a^(k+1)) / (1 - a)``). Depth 0 is plain decoding; while it wins,
a speculative probe still runs every ``probe_every`` steps so the estimates stay current.

Choices only depend on the past, never on values not yet drawn, so they cannot change what
the verifier emits: greedy output and the sampling distribution are unaffected.
"""

from __future__ import annotations


def expected_tokens(acceptance: list[float], k: int) -> float:
    """Expected tokens from one step with k drafts and per-depth conditional acceptance."""
    total, run = 1.0, 1.0
    for d in range(k):
        run *= acceptance[d]
        total += run
    return total


def leviathan_tokens(a: float, k: int) -> float:
    """``(1 - a^(k+1)) / (1 - a)``: expected tokens per step at constant acceptance ``a``."""
    if a >= 1.0:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


class _Ema:
    def __init__(self, alpha: float = 0.2):
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class AdaptiveController:
    def __init__(self, max_depth: int, enabled: bool = True, probe_every: int = 8, warmup: int = 4,
                 prior_acceptance: float = 0.5, prior_strength: float = 2.0):
        self.max_depth = max_depth
        self.enabled = enabled
        self.probe_every = probe_every
        self.warmup = warmup
        self.prior = (prior_acceptance * prior_strength, prior_strength)
        self.tried = [0] * (max_depth + 1)  # tried[d]: steps where depth d was drafted and d-1 reached
        self.passed = [0] * (max_depth + 1)
        self.verify_cost: dict[int, _Ema] = {}  # forward size -> seconds
        self.draft_cost: dict[int, _Ema] = {}  # depth -> seconds
        self.steps = 0
        self.plain_streak = 0
        self.last_choice = max_depth

    # -- estimates -------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        a0, n0 = self.prior
        return [(a0 + self.passed[d]) / (n0 + self.tried[d]) for d in range(1, self.max_depth + 1)]

    def observed_acceptance(self) -> list[float]:
        """Measured conditional acceptance per depth (no prior; 0.0 where never tried)."""
        return [self.passed[d] / self.tried[d] if self.tried[d] else 0.0 for d in range(1, self.max_depth + 1)]

    def _verify_seconds(self, n: int) -> float | None:
        if n in self.verify_cost:
            return self.verify_cost[n].value
        known = sorted((k, e.value) for k, e in self.verify_cost.items())
        if not known:
            return None
        if len(known) == 1:
            return known[0][1]
        # linear fit through the measured sizes (cost grows slowly with the number of tokens)
        xs, ys = zip(*known)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(my + max(slope, 0.0) * (n - mx), 1e-6)

    def expected_rate(self, k: int, nodes: int) -> float | None:
        verify = self._verify_seconds(nodes if k else 1)
        if verify is None:
            return None
        draft = self.draft_cost[k].value if k in self.draft_cost else (
            (max(self.draft_cost.items())[1].value * k / max(self.draft_cost)) if self.draft_cost else 0.0)
        tokens = expected_tokens(self.acceptance(), k) if k else 1.0
        return tokens / (verify + (draft if k else 0.0))

    # -- decisions -------------------------------------------------------------------
    def choose(self, nodes_for_depth) -> int:
        """Depth for the next step; ``nodes_for_depth(k)`` gives the forward size at depth k."""
        if not self.enabled or self.max_depth == 0:
            return self.max_depth
        self.steps += 1
        if self.steps == 1:
            return 0  # one plain step measures the single-token cost
        if self.steps <= self.warmup + 1:
            return self.max_depth
        rates = {k: self.expected_rate(k, nodes_for_depth(k)) for k in range(self.max_depth + 1)}
        if any(r is None for r in rates.values()):
            return self.max_depth
        best = max(rates, key=lambda k: (rates[k], -k))
        if best == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                self.plain_streak = 0
                best = max((k for k in rates if k > 0), key=lambda k: rates[k])
        else:
            self.plain_streak = 0
        self.last_choice = best
        return best

    def record(self, depth_drafted: int, accepted: int, forward_size: int, verify_s: float, draft_s: float) -> None:
        for d in range(1, depth_drafted + 1):
            if d - 1 > accepted:
                break
            self.tried[d] += 1
            self.passed[d] += int(accepted >= d)
        self.verify_cost.setdefault(forward_size, _Ema()).update(verify_s)
        if depth_drafted:
            self.draft_cost.setdefault(depth_drafted, _Ema()).update(draft_s)

