"""Adaptive speculation: pick the draft *shape* (depth and node count) that maximises expected
tokens per second, from measured acceptance and this machine's measured costs.

A shape is ``(k, n)``: a draft of depth ``k`` verified as ``n`` nodes (root included); ``(0, 1)``
is plain decoding, ``(k, k + 1)`` a chain. Per shape the controller estimates

- expected tokens per step: a model from the per-depth conditional acceptance
  ``a_d = P(depth d accepted | depth d-1 accepted)`` (``1 + sum_j prod_{i<=j} a_i``, Leviathan et
  al.'s ``(1 - a^(k+1)) / (1 - a)`` for constant ``a``), widened for trees as if each of the
  ``b = (n - 1) / k`` candidates per level had an independent chance ``a_d``, times that shape's
  calibration: the tokens it really produced over the tokens the model predicted for those steps
  (a tree shape not run yet takes the calibration of the tree shapes that did: siblings are
  correlated, so the independent widening is optimistic and the measured ratio corrects it);
- verification time of ``n`` nodes: measured per forward size, and for sizes not yet run the
  nearest measured size scaled by the target's measured cost curve ``cost(n) / cost(1)`` (on a CPU
  verification is compute-bound and the curve decides between chains and trees);
- drafting time: measured per shape, else per depth.

Plain decoding runs once first (to measure a single-token step) and whenever it wins; a
speculative probe still runs every ``probe_every`` plain steps so the estimates stay current.
Acceptance counts decay by ``decay`` per speculative step (a window of ~``1/(1-decay)`` steps;
the per-shape calibrations do not, they describe the shape): a controller kept across requests
follows the prompt it is on (measured:
with cumulative counts, 100 earlier prompts kept it speculating on translation prompts where the
head accepts ~10% of its drafts, 0.74x plain decoding).
Choices only depend on the past, never on values not yet drawn, so they cannot change what the
verifier emits: greedy output and the sampling distribution are unaffected.
"""

from __future__ import annotations

import bisect
import math
import numbers

Shape = tuple[int, int]

#: hard upper bounds on a draft's shape (depth below the root, nodes including the root) and on
#: an EAGLE tree's branching: inputs (API, CLI, checkpoint ``config.json``) beyond them are
#: refused. Generous for any real speculator (EAGLE-2/3 use depth <= 10, <= 64 nodes), small
#: enough that one step's drafting, verification and controller work stay bounded.
MAX_DRAFT_DEPTH = 32
MAX_DRAFT_NODES = 256
MAX_DRAFT_TOP_K = 64


#: the runtime-shape candidates timed by default (runtime/tune.py, the recipes' evaluation): the
#: natural shape under the adaptive controller, fixed chains of 2-3 (what won on the AMD EPYC
#: machines measured so far) and small fixed trees (what won on an Intel CPU with AMX, where
#: verifying 4-8 tokens costs little more than one; docs/results.md, ninth session)
# the first is the prior: the runtime-shape measurement keeps it unless another candidate beats it on
# (nearly) every prompt (runtime/tune.py); tree@2/4 was the fastest on Spec-Bench for the default and
# the long head in every session that compared them (docs/results.md, twenty-fifth to thirtieth)
RUNTIME_SHAPE_CANDIDATES = ("tree@2/4", "adaptive", "chain@2", "chain@3", "tree@2/6", "tree@3/8")


def parse_shape_candidate(spec: str) -> tuple[str, int | None, int | None]:
    """A runtime-shape candidate (runtime/tune.py) -> ``(kind, depth, nodes)``: ``"adaptive"`` ->
    ``("adaptive", None, None)``; ``"chain@K"`` -> ``("chain", K, None)``; ``"tree@K/N"`` (a fixed
    EAGLE-2 tree of depth ``K`` and ``N`` nodes, root included, ``N >= K + 2``) -> ``("tree", K, N)``."""
    if spec == "adaptive":
        return "adaptive", None, None
    kind, _, rest = spec.partition("@")
    depth, _, nodes = rest.partition("/")
    if kind not in ("chain", "tree") or not depth.isdigit() or (kind == "tree") != nodes.isdigit():
        raise ValueError(f"runtime shape candidate {spec!r}: expected 'adaptive', 'chain@K' or 'tree@K/N'")
    k = check_int(f"{spec}: K", int(depth), 1, MAX_DRAFT_DEPTH)
    if kind == "chain":
        return "chain", k, None
    return "tree", k, check_int(f"{spec}: N", int(nodes), k + 2, MAX_DRAFT_NODES)


def tree_options(depth: int, nodes: int) -> dict:
    """EAGLE drafter options of a fixed tree of ``depth`` levels and ``nodes`` nodes (root
    included): children per expanded node ``top_k = min(4, nodes - 1)`` (the default recipe's
    evaluation tree has 4)."""
    return {"tree": "dynamic", "depth": depth, "total_tokens": nodes, "top_k": min(4, nodes - 1)}


def check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]``, or one ValueError naming ``name`` (bools, floats and
    strings are refused, not coerced)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r:.60}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {rng}, got {value}")
    return int(value)


def check_real(name: str, value, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> float:
    """``value`` as a finite float in the given range, or one ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r:.60}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x}")
    if lo is not None and (x <= lo if lo_open else x < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {x}")
    if hi is not None and x > hi:
        raise ValueError(f"{name} must be <= {hi}, got {x}")
    return x


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


class AcceptanceTally:
    """Per-depth conditional acceptance counts: ``tried[d]`` steps drafted depth d with depth d-1
    accepted, ``passed[d]`` of them accepted depth d."""

    def __init__(self, max_depth: int):
        self.tried = [0] * (max_depth + 1)
        self.passed = [0] * (max_depth + 1)

    def record(self, depth_drafted: int, accepted: int) -> None:
        grow = depth_drafted + 1 - len(self.tried)
        if grow > 0:  # a deeper draft than planned for
            self.tried += [0] * grow
            self.passed += [0] * grow
        for d in range(1, depth_drafted + 1):
            if d - 1 > accepted:
                break
            self.tried[d] += 1
            self.passed[d] += int(accepted >= d)

    def observed(self) -> list[float]:
        """Measured conditional acceptance per depth (0.0 where never tried)."""
        return [p / t if t else 0.0 for p, t in zip(self.passed[1:], self.tried[1:])]


def clean_cost_curve(curve) -> dict[int, float]:
    """A measured cost curve (forward size -> relative cost) made usable: only sane points (a NaN
    or non-positive cost would make every rate NaN and the choice arbitrary), sorted, and made
    non-decreasing by pooling adjacent violators (a least-squares monotone fit). A larger forward
    never costs less than a smaller one; a dip is the noise of a short measurement (seen on a
    noisy 2-core machine: ``{1: 1.0, 2: 0.93, 4: 1.06}``), and taken as is it priced a 2-row step
    below a plain one and made the serving policy prefer chains of 1 to the head's small tree."""
    pts = sorted((int(n), float(c)) for n, c in (curve or {}).items()
                 if isinstance(n, numbers.Integral) and n >= 1
                 and isinstance(c, numbers.Real) and math.isfinite(c) and c > 0)
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for _, c in pts:
        blocks.append([c, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, k = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += k
    values = [s / k for s, k in blocks for _ in range(int(k))]
    return {n: v for (n, _), v in zip(pts, values)}


class AdaptiveController:
    def __init__(self, max_depth: int, enabled: bool = True, probe_every: int = 8, warmup: int = 4,
                 prior_acceptance: float = 0.5, prior_strength: float = 2.0,
                 cost_curve: dict[int, float] | None = None, decay: float = 0.95):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_depth = max_depth
        self.decay = decay
        self.enabled = enabled
        self.probe_every = probe_every
        self.warmup = warmup
        self.prior = (prior_acceptance * prior_strength, prior_strength)
        self.cost_curve = clean_cost_curve(cost_curve)  # forward size -> relative cost
        self.tally = AcceptanceTally(max_depth)
        self.verify_cost: dict[int, _Ema] = {}  # forward size -> seconds
        self.draft_cost: dict[Shape, _Ema] = {}  # shape -> seconds
        self.shape_calib: dict[Shape, list[float]] = {}  # shape -> [tokens produced, tokens the model predicted]
        self.tree_calib = [0.0, 0.0]  # the same pooled over every tree shape (kept as it goes: O(1) per lookup)
        self.steps = 0
        self.plain_streak = 0
        # unit operations of the last choose() (acceptance terms and expected-token products): a
        # per-step cost that is bounded because the depth and the shape list are
        self.work = 0

    # -- estimates -------------------------------------------------------------------
    def acceptance(self) -> list[float]:
        a0, n0 = self.prior
        t = self.tally
        return [(a0 + t.passed[d]) / (n0 + t.tried[d]) for d in range(1, self.max_depth + 1)]

    def _curve(self, n: int) -> float | None:
        """Relative cost of an ``n``-node forward, interpolated in the measured curve."""
        pts = list(self.cost_curve.items())
        if not pts:
            return None
        if n <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] + 1, pts[0][1]))
        return y1 + max(y1 - y0, 0.0) / (x1 - x0) * (n - x1)

    def _verify_summary(self):
        """Measured verification sizes, sorted, and the no-curve linear fit through them: one pass
        over the measurements, shared by every shape a step compares."""
        known = sorted((k, e.value) for k, e in self.verify_cost.items())
        self.work += len(known)
        fit = None
        if len(known) > 1:
            xs, ys = zip(*known)
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            fit = (mx, my, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0)
        return known, [k for k, _ in known], fit

    def verify_seconds(self, n: int, summary=None) -> float | None:
        if n in self.verify_cost:
            return self.verify_cost[n].value
        known, xs, fit = summary if summary is not None else self._verify_summary()
        if not known:
            return None
        i = bisect.bisect_left(xs, n)  # the nearest measured size (the smaller one on a tie)
        cands = [known[j] for j in (i - 1, i) if 0 <= j < len(known)]
        near, secs = min(cands, key=lambda kv: abs(kv[0] - n))
        if self.cost_curve:
            self.work += len(self.cost_curve)
            return secs * self._curve(n) / self._curve(near)
        if fit is None:
            return secs
        # no curve: a linear fit through the measured sizes
        mx, my, slope = fit
        return max(my + max(slope, 0.0) * (n - mx), 1e-6)

    def _draft_summary(self) -> tuple[dict[int, float], tuple[int, float] | None]:
        """(cheapest measured drafting time per depth, (deepest-largest measured shape's depth, its
        time)): one pass over the measurements, shared by every shape a step compares."""
        by_depth: dict[int, float] = {}
        for (k, _), e in self.draft_cost.items():
            by_depth[k] = min(by_depth.get(k, e.value), e.value)
        self.work += len(self.draft_cost)
        if not self.draft_cost:
            return by_depth, None
        (k, _), e = max(self.draft_cost.items())
        return by_depth, (k, e.value)

    def draft_seconds(self, shape: Shape, summary=None) -> float:
        if shape[0] == 0:
            return 0.0
        if shape in self.draft_cost:
            return self.draft_cost[shape].value
        by_depth, deepest = summary if summary is not None else self._draft_summary()
        if shape[0] in by_depth:
            return by_depth[shape[0]]
        if deepest is None:
            return 0.0
        k, secs = deepest
        return secs * shape[0] / k

    def model_tokens(self, shape: Shape, acceptance: list[float] | None = None) -> float:
        """Expected new tokens per step of ``shape`` from the acceptance model alone."""
        k, n = shape
        if k == 0:
            return 1.0
        b = max(1.0, (n - 1) / k)
        acceptance = self.acceptance() if acceptance is None else acceptance
        self.work += k
        return expected_tokens([1 - (1 - a) ** b for a in acceptance[:k]], k)

    def calibration(self, shape: Shape) -> float:
        """Tokens produced / tokens predicted by the model over ``shape``'s steps, shrunk towards 1
        by ``prior_strength`` steps' worth of agreement; unmeasured tree shapes pool the tree
        shapes measured so far."""
        hit = self.shape_calib.get(shape)
        if hit is None and shape[1] > shape[0] + 1 and self.tree_calib[1] > 0:
            hit = self.tree_calib
        if hit is None:
            return 1.0
        s0 = self.prior[1]
        return (hit[0] + s0) / (hit[1] + s0)

    def tokens(self, shape: Shape, acceptance: list[float] | None = None) -> float:
        """Expected new tokens per step of ``shape``: the model times the shape's calibration;
        ``acceptance``: :meth:`acceptance`, when the caller already computed it."""
        if shape[0] == 0:
            return 1.0
        return max(1.0, self.model_tokens(shape, acceptance) * self.calibration(shape))

    def expected_rate(self, shape: Shape, acceptance: list[float] | None = None, summary=None,
                      verify_summary=None) -> float | None:
        verify = self.verify_seconds(shape[1] if shape[0] else 1, verify_summary)
        if verify is None:
            return None
        return self.tokens(shape, acceptance) / (verify + self.draft_seconds(shape, summary))

    # -- decisions -------------------------------------------------------------------
    def new_request(self) -> None:
        """A new prompt: acceptance depends on it, so the first step that would go plain probes
        speculation instead (a controller reused across requests keeps its measurements)."""
        self.plain_streak = max(self.plain_streak, self.probe_every - 1)

    def choose(self, shapes: list[Shape]) -> Shape:
        """The shape for the next step among ``shapes`` (the last one is the largest, used when
        the controller is disabled or still warming up)."""
        fixed = shapes[-1]
        self.work = 0
        if not self.enabled or self.max_depth == 0:
            return fixed
        self.steps += 1
        if self.steps == 1:
            return (0, 1)  # one plain step measures the single-token cost
        if self.steps <= self.warmup + 1:
            return fixed
        acceptance = self.acceptance()  # once per step, not once per shape
        self.work += len(acceptance)
        summary, vsummary = self._draft_summary(), self._verify_summary()
        rates = {s: self.expected_rate(s, acceptance, summary, vsummary) for s in [(0, 1), *shapes]}
        if any(r is None for r in rates.values()):
            return fixed
        best = max(rates, key=lambda s: (rates[s], -s[1]))
        if best[0] == 0:
            self.plain_streak += 1
            if self.plain_streak >= self.probe_every:
                self.plain_streak = 0
                best = max((s for s in rates if s[0] > 0), key=lambda s: rates[s])
        else:
            self.plain_streak = 0
        return best

    def record(self, shape: Shape, depth_drafted: int, accepted: int, forward_size: int, verify_s: float,
               draft_s: float) -> None:
        # a clock can step backwards (or a caller pass garbage): never let a NaN/negative time in
        verify_s = verify_s if math.isfinite(verify_s) and verify_s > 0 else 1e-9
        draft_s = draft_s if math.isfinite(draft_s) and draft_s >= 0 else 0.0
        if shape[0]:  # the model's prediction for this step, before this step's evidence
            predicted = self.model_tokens(shape)
            sinks = [self.shape_calib.setdefault(shape, [0.0, 0.0])]
            if shape[1] > shape[0] + 1:
                sinks.append(self.tree_calib)
            for c in sinks:
                c[0] += accepted + 1
                c[1] += predicted
        if depth_drafted and self.decay < 1.0:  # old acceptance evidence fades (see the module docstring)
            t = self.tally
            t.tried = [x * self.decay for x in t.tried]
            t.passed = [x * self.decay for x in t.passed]
        self.tally.record(depth_drafted, accepted)
        self.verify_cost.setdefault(forward_size, _Ema()).update(verify_s)
        if shape[0]:
            self.draft_cost.setdefault(shape, _Ema()).update(draft_s)
