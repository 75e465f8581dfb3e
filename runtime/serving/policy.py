"""Load-aware speculation for the serving batch: how deep to draft (0 = not at all) each step.

Scope: the per-step decision and the per-request acceptance monitor; nothing about running it.

Speculation pays at small batch and costs at large batch: one step verifies ``sum_b (k_b + 1)``
rows, and on a CPU (and on a GPU past its memory-bound region) a forward's cost grows with its
rows. Each step :meth:`SpeculationPolicy.choose` picks the chain depth ``k`` that maximises the
batch's expected tokens per second::

    rate(k) = sum_b tau_b(k_b) / (unit * cost(sum_b rows_b(k_b)) + draft_fixed + draft * sum_b k_b + overhead)

where ``cost(rows)`` is this machine's measured forward cost relative to one row (the target's
cost curve, made non-decreasing and extrapolated linearly past its last point), ``unit`` the
measured seconds of one cost unit, measured apart for plain steps and steps with drafts: the
kinds the serving forward attends differently (with the CPU kernel, every row in one call, up to
:attr:`SpeculationPolicy.plain_rows` rows per sequence; above that by SDPA per range of rows: on
SDPA one lookup row of 3 tokens turned a 16-row step into a slower kind of step, which a price by
rows alone did not see) and per range of batch sizes (a unit of the single-sequence curve costs
more seconds at 32 rows than at 8: every row attends over its own context; plain units measured at
4-8 rows were 60-70% of the 32-row one), ``draft_fixed + draft * x`` the measured
drafting seconds of a step that drafts ``x`` tokens (a line fitted to the last steps; nothing when no row drafts with
the head), ``overhead`` the measured seconds a step spends outside drafting and verification
(handing its tokens to the clients, the loop between steps: paid once per step whatever its depth, so
a step that yields more tokens amortises it), and ``tau_b(k)`` the expected tokens of
request ``b`` at depth ``k`` from its own rolling acceptance (the server-wide acceptance as its
prior). ``k_b = k`` for requests whose monitor has speculation on, else 0. ``rows_b(k)`` is
``k + 1`` (a chain), except that a greedy request whose head drafts a small tree at its full depth
(the head's measured runtime shape, e.g. ``tree@3/8``) verifies that tree's nodes there
(:attr:`AcceptanceMonitor.tree_nodes`): the tree's rows are priced, and its expected tokens come
from tree steps only (the request's own and the server's pooled tree figures), apart from the
chains' (a tree accepts more at its first position than a chain: one tally for both made the
chain estimates the tree's, or kept the tree from ever being tried).

:class:`AcceptanceMonitor` keeps a request's last ``window`` speculative steps; when even alone
(batch 1) no depth would beat plain decoding on those figures, speculation stops for that request
and is re-probed after ``reprobe`` plain steps. A request may opt out (``speculate=False``).

Prompt lookup (a row whose context's suffix occurred before, drafting what followed it: no head
forward) is decided per row after that, by :meth:`SpeculationPolicy.take_lookups`: a row's lookup
chain replaces its depth when it raises the batch's expected rate at the lookup drafts' own pooled
acceptance, whatever the depth chosen above (even 0, or a request whose monitor has the head off:
at small batch an extra row is nearly free, as in the single-stream generator, which always takes
a lookup draft; at large batch only a lookup that accepts well enough is worth its rows). Lookup
steps are kept out of the head's acceptance figures.

Where steps with drafts were measured at a batch size and plain steps never were (under load every
step took lookups, so the plain price was a guess), the next step is plain: its price is measured
before speculation is priced against it (measured at 32 clients: with plain steps priced at the
unit of all steps, mostly drafting ones, every step took 6-14 lookup chains and cost 1.6x a plain
step for 1.4x its tokens).

Speculation is taken only when its expected rate beats not speculating by :data:`MARGIN` (5%):
the estimates err, and under load the choices the policy made near break-even measured at a loss
(at 32 clients, lookup steps cost 1.2x a plain step for ~1.2x its tokens, and the servers' sweeps
had load-aware 5-14% behind `off` at 16-32 clients), while where speculation pays (few clients) it
pays by 25-50% and the margin changes nothing.

A table in the style of vLLM's ``num_speculative_tokens_per_batch_size`` (``"1-4:3,5-8:1,9-:0"``)
overrides the cost model's depth; the per-request monitor still applies. When the estimates
say no depth pays, a depth-1 probe still runs every ``probe_every`` steps so they stay current, on
at most ``probe_rows`` requests (taken in turn): a probe of every row of a large batch made each
of them catch its head up on its whole prompt (:mod:`.drafts` runs a row's head lazily).
"""

from __future__ import annotations

from collections import deque

from ..adaptive import AcceptanceTally, clean_cost_curve, expected_tokens


def parse_table(spec: str | None, max_depth: int) -> list[tuple[int, int, int]] | None:
    """``"1-4:3,5-8:1,9-:0"`` -> ``[(1, 4, 3), (5, 8, 1), (9, inf, 0)]`` (batch range -> depth)."""
    if spec is None or spec == "":
        return None
    table = []
    for part in spec.split(","):
        try:
            rng, depth = part.split(":")
            lo, _, hi = rng.partition("-")
            lo_i = int(lo)
            hi_i = int(hi) if hi else (lo_i if "-" not in rng else 1 << 30)
            d = int(depth)
        except ValueError:
            raise ValueError(f"bad speculation table entry {part!r}: expected 'LO-HI:DEPTH', 'LO-:DEPTH' or "
                             f"'N:DEPTH' (e.g. '1-4:3,5-8:1,9-:0')") from None
        if lo_i < 1 or hi_i < lo_i or not 0 <= d <= max_depth:
            raise ValueError(f"bad speculation table entry {part!r}: need 1 <= LO <= HI and 0 <= DEPTH <= {max_depth}")
        table.append((lo_i, hi_i, d))
    return table


class AcceptanceMonitor:
    """One request's acceptance over its last ``window`` speculative steps, and whether it
    speculates now (see the module docstring)."""

    def __init__(self, max_depth: int, window: int = 16, reprobe: int = 32, enabled: bool = True,
                 tree_nodes: int | None = None):
        self.max_depth = max_depth
        self.tree_nodes = tree_nodes  # nodes of the tree drafted at max_depth (None: a chain)
        self.steps: deque[tuple[int, int]] = deque(maxlen=window)  # chain steps
        self.tree_steps: deque[tuple[int, int]] = deque(maxlen=window)  # tree steps (tree_nodes set)
        self.reprobe = reprobe
        self.enabled = enabled  # False: the request opted out
        self.off_for = 0  # plain steps left before re-probing
        self.turned_off = 0  # times the monitor switched this request off
        # the window's tallies (chain, tree), kept until the window changes: a step asks every row's
        # acceptance several times and under load most rows record plain steps that change nothing
        self._tallies: dict[bool, AcceptanceTally] = {}

    def record(self, depth_drafted: int, accepted: int, tree: bool = False) -> None:
        if depth_drafted:
            (self.tree_steps if tree else self.steps).append((depth_drafted, accepted))
            self._tallies.pop(tree, None)
        elif self.off_for:
            self.off_for -= 1

    def acceptance(self, prior: list[float], weight: float = 4.0, tree: bool = False) -> list[float]:
        """Per-depth conditional acceptance from the window (of chain steps, or of tree steps),
        shrunk towards ``prior`` with the weight of ``weight`` observations (a new request starts
        at the prior)."""
        tally = self._tallies.get(tree)
        if tally is None:
            tally = self._tallies[tree] = AcceptanceTally(self.max_depth)
            for d, a in (self.tree_steps if tree else self.steps):
                tally.record(d, a)
        return [(p + weight * pr) / (t + weight) for p, t, pr in zip(tally.passed[1:], tally.tried[1:], prior)]

    def rows(self, depth: int) -> int:
        """Verified rows of a step drafted at ``depth``: the tree's nodes at full depth, else a chain's."""
        return self.tree_nodes if self.tree_nodes and depth == self.max_depth else depth + 1

    @property
    def speculating(self) -> bool:
        return self.enabled and self.off_for == 0

    def switch_off(self) -> None:
        self.off_for = self.reprobe
        self.steps.clear()  # the re-probe starts from the prior again
        self.tree_steps.clear()
        self._tallies.clear()
        self.turned_off += 1


class SpeculationPolicy:
    """Chooses each step's depth per request (see the module docstring).

    ``cost(rows)``: the forward cost of ``rows`` new tokens relative to one (a dict from the
    target's ``cost_curve()`` or any callable); ``table``: an override (:func:`parse_table`).
    """

    def __init__(self, max_depth: int, cost=None, table: str | None = None, *, window: int = 16,
                 reprobe: int = 32, min_steps: int = 4, probe_every: int = 64, lookup_depth: int | None = None,
                 probe_rows: int = 2):
        self.max_depth = max_depth  # the head's
        self.lookup_depth = max_depth if lookup_depth is None else lookup_depth  # a lookup chain's
        # a measured curve's dips are noise (:func:`~..adaptive.clean_cost_curve`); no sane point: no curve
        self._cost = (clean_cost_curve(cost) or None) if isinstance(cost, dict) else cost
        self.table = parse_table(table, max_depth)
        self.window, self.reprobe, self.min_steps = window, reprobe, min_steps
        # when the estimates say "never speculate", one depth-1 step every probe_every steps keeps
        # them current (traffic changes; the server-wide prior would otherwise never move again)
        self.probe_every, self.probe_rows = probe_every, probe_rows
        self._since_draft = 0
        self._probes = 0  # probes so far: whose turn it is
        self.pooled = AcceptanceTally(max_depth)  # every request's chain steps: the prior of new ones
        self.pooled_tree = AcceptanceTally(max_depth)  # every request's tree steps
        self.lookups = AcceptanceTally(self.lookup_depth)  # prompt-lookup steps, apart from the head's
        self.unit: float | None = None  # seconds per cost unit (measured, any step)
        # the same per kind of step: plain (False) and with drafts (True); None until measured
        self.units: dict[bool, float | None] = {False: None, True: None}
        # and per kind and range of batch sizes (:func:`batch_range`): what a step is priced at
        self.units_at: dict[tuple[bool, int], float] = {}
        # drafting seconds of a step = draft_fixed + draft * (head-drafted tokens), fitted to the
        # measured steps (:meth:`record_step`)
        self.draft: float | None = None  # seconds per drafted token per row
        self.draft_fixed = 0.0  # seconds per step that drafts at all
        self._draft_sums = [0.0] * 5  # decayed sums of 1, x, y, x^2, x*y (x drafted, y seconds)
        self.overhead = 0.0  # seconds per step outside drafting and verification (measured)
        # speculation (a depth, or the lookups of a step) is taken only when its expected rate beats
        # not speculating by this fraction (see the module docstring)
        self.margin = MARGIN
        # a step verifying at most this many rows per sequence is of the plain kind (the serving
        # engine sets its attention's threshold, :func:`.slots.uses_kernel`; 1.0: plain steps only)
        self.plain_rows = 1.0

    def monitor(self, speculate: bool = True, tree_nodes: int | None = None) -> AcceptanceMonitor:
        return AcceptanceMonitor(self.max_depth, self.window, self.reprobe, enabled=speculate and self.max_depth > 0,
                                 tree_nodes=tree_nodes)

    # -- costs -----------------------------------------------------------------------------
    def cost(self, rows: int) -> float:
        c = self._cost
        if c is None:
            return float(rows)  # no curve: assume compute-bound (the cautious default)
        if callable(c):
            return float(c(rows))
        if rows in c:
            return float(c[rows])
        sizes = sorted(c)
        if rows <= sizes[0]:
            return float(c[sizes[0]])
        for lo, hi in zip(sizes, sizes[1:]):
            if rows <= hi:
                return c[lo] + (c[hi] - c[lo]) * (rows - lo) / (hi - lo)
        if len(sizes) == 1:
            return float(c[sizes[0]])
        lo, hi = sizes[-2], sizes[-1]  # past the curve: extend its last slope
        return c[hi] + (c[hi] - c[lo]) / (hi - lo) * (rows - hi)

    def prior(self) -> list[float]:
        """Server-wide acceptance by depth: the pooled counts with :data:`PRIOR_STEPS` steps at 0.5
        (worth a probe) before any were measured, so a server's first few drafts do not decide
        alone (one rejected first draft read as 0% acceptance kept a server plain until probes)."""
        return _smoothed(self.pooled)

    def tree_prior(self) -> list[float]:
        """Server-wide acceptance by depth of the tree steps (smoothed as :meth:`prior`)."""
        return _smoothed(self.pooled_tree)

    def estimates(self, monitors: list) -> list[tuple[list[float], list[float] | None]]:
        """Per request (chain acceptance, tree acceptance or None for a request without a tree)."""
        prior, tprior = self.prior(), self.tree_prior()
        return [(m.acceptance(prior), m.acceptance(tprior, tree=True) if m.tree_nodes else None) for m in monitors]

    def tokens(self, estimate: tuple[list[float], list[float] | None], depth: int) -> float:
        """Expected tokens of one request's step at ``depth`` (its tree's figures at full depth)."""
        chain, tree = estimate
        return expected_tokens(tree if tree is not None and depth == self.max_depth else chain, depth)

    def lookup_acceptance(self) -> list[float]:
        """Pooled acceptance by depth of the prompt-lookup drafts (smoothed as :meth:`prior`)."""
        return _smoothed(self.lookups)

    def record_lookup(self, depth_drafted: int, accepted: int) -> None:
        """One verified prompt-lookup step (not the head's: its monitor and prior are left alone)."""
        if depth_drafted:
            self.lookups.record(min(depth_drafted, self.lookup_depth), min(accepted, self.lookup_depth))

    def take_lookups(self, monitors: list[AcceptanceMonitor], depths: list[int], lengths: list[int]) -> list[bool]:
        """For each row, whether it drafts its prompt-lookup chain of ``lengths[b]`` tokens (0: it has
        none) instead of ``depths[b]`` (from :meth:`choose`): rows in order, each taken when that raises
        the batch's expected rate (tokens per second of :meth:`rate`; a lookup draft costs its rows in
        the forward and nothing to draft)."""
        if self.plain_unmeasured(len(depths)):
            return [False] * len(depths)
        look = self.lookup_acceptance()
        est = self.estimates(monitors)
        tokens = sum(self.tokens(e, k) for e, k in zip(est, depths))
        rows, drafted, B = sum(m.rows(k) for m, k in zip(monitors, depths)), sum(depths), len(depths)
        base = tokens / self.seconds(rows, drafted, B)
        take = [False] * len(depths)
        for b, n in enumerate(lengths):
            if n <= 0:
                continue
            n = min(n, self.lookup_depth)
            t2 = tokens - self.tokens(est[b], depths[b]) + expected_tokens(look, n)
            r2, d2 = rows - monitors[b].rows(depths[b]) + n + 1, drafted - depths[b]
            if t2 / self.seconds(r2, d2, B) >= tokens / self.seconds(rows, drafted, B):
                take[b] = True
                tokens, rows, drafted = t2, r2, d2
        if any(take) and tokens / self.seconds(rows, drafted, B) <= base * (1.0 + self.margin):
            return [False] * len(depths)  # within the margin of not looking up: not worth the risk
        return take

    def record_step(self, verify_seconds: float, rows: int, draft_seconds: float, drafted: int,
                    batch: int | None = None) -> None:
        """Measured seconds of one step of ``batch`` sequences (None: its kind unknown, only the
        unit of all steps learns from it): the forward over ``rows`` rows and the drafting of
        ``drafted`` depths by the head (summed over rows: a chain of ``k`` or a tree ``k`` deep each
        cost ``k`` head forwards; prompt-lookup drafts cost no drafting; the
        drafters' commits are counted in ``draft_seconds``: charging them to no depth instead was
        tried and measured no better, docs/results.md seventh session); the drafting seconds go into
        the fitted line of :meth:`_fit_draft`."""
        unit = verify_seconds / self.cost(rows)
        self.unit = unit if self.unit is None else 0.8 * self.unit + 0.2 * unit
        if batch is not None:
            kind = self.kind(rows, batch)
            old = self.units[kind]
            self.units[kind] = unit if old is None else 0.8 * old + 0.2 * unit
            key = (kind, batch_range(batch))
            old = self.units_at.get(key)
            self.units_at[key] = unit if old is None else 0.8 * old + 0.2 * unit
        if drafted:
            self._fit_draft(drafted, draft_seconds)

    def record_overhead(self, seconds: float) -> None:
        """Measured seconds between one decode step's end of verification and drafting and the next
        step's start, when nothing else ran between them (no admission, no memory trim): 5-9 ms a
        step over HTTP here (~10% of a 1-client step), the same at any depth. Left out, a chain of 1
        was priced as good as the head's tree at 1 client and the server drafted less than
        always-on (docs/results.md, nineteenth session)."""
        if seconds >= 0.0:
            self.overhead = seconds if not self.overhead else 0.9 * self.overhead + 0.1 * seconds

    def _fit_draft(self, x: int, y: float) -> None:
        """Drafting seconds as ``draft_fixed + draft * x``, a least-squares line through the last
        ~:data:`DRAFT_WINDOW` drafting steps. Part of a step's drafting does not grow with its
        depth (the head's pass over the last step's accepted tokens, the bookkeeping); charged per
        drafted token, as before, it priced a depth-2 step at twice a depth-1 step and kept the
        policy on chains of 1. With one depth seen (no spread to fit a line) every second is
        charged per token."""
        s = self._draft_sums
        decay = 1.0 - 1.0 / DRAFT_WINDOW
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = decay * s[i] + v
        w, sx, sy, sxx, sxy = s
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 0.05:  # (about a twentieth of the steps at a depth one apart is enough)
            self.draft, self.draft_fixed = my / mx, 0.0
            return
        slope = (sxy / w - mx * my) / var
        fixed = my - slope * mx
        if slope < 0.0:  # the least-squares fit under slope >= 0 and fixed >= 0
            slope, fixed = 0.0, my
        elif fixed < 0.0:
            slope, fixed = sxy / sxx, 0.0
        self.draft, self.draft_fixed = slope, fixed

    def record(self, monitor: AcceptanceMonitor, depth_drafted: int, accepted: int, tree: bool = False) -> None:
        """One request's verified step (``tree``: a draft tree, not a chain); switches its
        speculation off when it no longer pays."""
        if depth_drafted:
            (self.pooled_tree if tree else self.pooled).record(depth_drafted, accepted)
        monitor.record(depth_drafted, accepted, tree)
        # judged after the request's own drafted steps: a plain step leaves its acceptance as it was
        # (under load most rows' steps are plain, and judging each row costs a best_depth)
        if depth_drafted and monitor.speculating and len(monitor.steps) + len(monitor.tree_steps) >= self.min_steps \
                and self.best_depth([monitor]) == 0:
            monitor.switch_off()

    # -- the decision ----------------------------------------------------------------------
    def rate(self, monitors: list[AcceptanceMonitor], estimates: list, depths: list[int]) -> float:
        """Expected tokens per second (per cost unit before anything is measured) of one step:
        ``estimates`` from :meth:`estimates`, each request's rows priced by its monitor."""
        tokens = sum(self.tokens(e, k) for e, k in zip(estimates, depths))
        return tokens / self.seconds(sum(m.rows(k) for m, k in zip(monitors, depths)), sum(depths), len(depths))

    def unit_of(self, kind: bool, batch: int) -> float | None:
        """Seconds per cost unit of a step of ``kind`` at ``batch`` sequences: measured at this range
        of batch sizes; else the other kind's there, scaled by the two kinds' ratio over all sizes;
        else this kind's over all sizes (None: not measured)."""
        r = batch_range(batch)
        if (kind, r) in self.units_at:
            return self.units_at[(kind, r)]
        other, mine = self.units_at.get((not kind, r)), self.units[kind]
        if other is not None and mine and self.units[not kind]:
            return other * mine / self.units[not kind]
        return mine

    def plain_unmeasured(self, batch: int) -> bool:
        """Steps with drafts were measured at this range of batch sizes and plain steps never were:
        the next step runs plain (see the module docstring). Not with a table (it decides alone)."""
        r = batch_range(batch)
        return self.table is None and (True, r) in self.units_at and (False, r) not in self.units_at

    def kind(self, rows: int, batch: int) -> bool:
        """A step of ``batch`` sequences verifying ``rows`` rows: False for the plain kind, True for
        the kind with drafts (see the module docstring)."""
        return rows > self.plain_rows * batch

    def seconds(self, rows: int, drafted: int, batch: int | None = None) -> float:
        """Expected seconds (cost units before anything is measured) of a step of ``batch``
        sequences verifying ``rows`` rows with ``drafted`` head-drafted tokens, its per-step
        overhead included; priced at the unit of its kind of step (:meth:`kind`) once that was
        measured, else at the unit of all steps."""
        unit = (self.unit_of(self.kind(rows, batch), batch) if batch is not None else None) or self.unit or 1.0
        draft = self.draft if self.draft is not None else 0.0
        return unit * self.cost(rows) + (self.draft_fixed + draft * drafted if drafted else 0.0) + self.overhead

    def best_depth(self, monitors: list[AcceptanceMonitor]) -> int:
        """The depth (0 = none) that maximises the batch's expected rate, the speculating
        requests drafting that deep and the others plain."""
        acc = self.estimates(monitors)
        on = [m.speculating for m in monitors]
        if not any(on):
            return 0
        rates = [self.rate(monitors, acc, [k if o else 0 for o in on]) for k in range(self.max_depth + 1)]
        best = max(range(self.max_depth + 1), key=lambda k: (rates[k], -k))
        return best if rates[best] > rates[0] * (1.0 + self.margin) else 0

    def choose(self, monitors: list[AcceptanceMonitor]) -> list[int]:
        """This step's depth for each request of the batch."""
        if self.max_depth == 0:
            return [0] * len(monitors)
        k = None
        if self.table is not None:
            B = len(monitors)
            k = next((d for lo, hi, d in self.table if lo <= B <= hi), 0)
        if k is None:
            if self.plain_unmeasured(len(monitors)):
                return [0] * len(monitors)
            k = self.best_depth(monitors)
            if k == 0 and any(m.speculating for m in monitors):
                self._since_draft += 1
                if self._since_draft >= self.probe_every:
                    self._since_draft = 0
                    on = [b for b, m in enumerate(monitors) if m.speculating]
                    start = self._probes * self.probe_rows
                    self._probes += 1
                    probed = {on[(start + i) % len(on)] for i in range(min(self.probe_rows, len(on)))}
                    return [1 if b in probed else 0 for b in range(len(monitors))]
        if k:
            self._since_draft = 0
        return [k if m.speculating else 0 for m in monitors]


#: the expected gain over not speculating below which a step does not speculate (SpeculationPolicy.margin)
MARGIN = 0.05


def batch_range(batch: int) -> int:
    """The range of batch sizes a measured unit stands for: 1, 2-3, 4-7, 8-15, 16-31, 32-63, ..."""
    return max(1, batch).bit_length()


#: drafting steps the fit of their cost weighs (decay 1 - 1/DRAFT_WINDOW; ~2-4 s of steps at 1-2 clients)
DRAFT_WINDOW = 32

#: pseudo-steps at 50% acceptance behind every pooled figure (see SpeculationPolicy.prior)
PRIOR_STEPS = 8


def _smoothed(tally: AcceptanceTally) -> list[float]:
    return [(p + 0.5 * PRIOR_STEPS) / (t + PRIOR_STEPS) for p, t in zip(tally.passed[1:], tally.tried[1:])]
