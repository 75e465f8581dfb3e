"""τ and acceptance by position: the one definition every harness reports.

Scope: turning per-request counts into the figures the training evaluation, the bench, the
server's ``usage`` and the hold-out tools print. Nothing here measures anything.

- **τ** = new tokens / target forwards (decode steps; the prefill is not a step), **pooled** over
  requests: ``sum(new_tokens) / sum(target_forwards)``. The per-request spread (min / median /
  max of each request's own ratio) is reported beside it, never instead of it.
- **acceptance by position** ``d = 1..D``: conditional, pooled counts: of the steps that drafted
  depth ``d`` with depth ``d-1`` accepted (``tried[d]``), the share that accepted depth ``d``
  (``passed[d]``) — :class:`~specfoundry.runtime.adaptive.AcceptanceTally` counts them per request.
  With constant acceptance ``a`` a chain of ``k`` then gives ``(1-a^(k+1))/(1-a)`` tokens per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping

__all__ = ["summarize_tau"]


def _get(r, key, default=None):
    return r.get(key, default) if isinstance(r, Mapping) else getattr(r, key, default)


def _pool(rows: list[list[int]]) -> list[int]:
    out: list[int] = []
    for row in rows:
        for i, v in enumerate(row or []):
            out.extend([0] * (i + 1 - len(out)))
            out[i] += int(v)
    return out


def summarize_tau(records: Iterable) -> dict:
    """Records (mappings or objects such as ``GenerationStats``) with ``new_tokens``,
    ``target_forwards`` and optionally ``tried``/``passed`` (per-depth counts, depth 1 first) ->
    ``{"tau", "n", "tau_min", "tau_median", "tau_max", "acceptance_by_position", "tried", "passed",
    "new_tokens", "target_forwards"}`` (tau None when nothing was decoded)."""
    recs = [r for r in records if _get(r, "target_forwards")]
    new = sum(int(_get(r, "new_tokens", 0)) for r in recs)
    fwd = sum(int(_get(r, "target_forwards", 0)) for r in recs)
    per = [int(_get(r, "new_tokens", 0)) / int(_get(r, "target_forwards")) for r in recs]
    tried, passed = _pool([_get(r, "tried") for r in recs]), _pool([_get(r, "passed") for r in recs])
    passed += [0] * (len(tried) - len(passed))
    return {
        "tau": new / fwd if fwd else None, "n": len(recs),
        "tau_min": min(per) if per else None, "tau_median": statistics.median(per) if per else None,
        "tau_max": max(per) if per else None,
        "acceptance_by_position": [p / t if t else 0.0 for p, t in zip(passed, tried)],
        "tried": tried, "passed": passed[: len(tried)], "new_tokens": new, "target_forwards": fwd,
    }
