"""The runtime default draft shape of a trained EAGLE head, measured on this machine.

Why: the shape a training run measures tau with (e.g. 32-node EAGLE-2 trees) is rarely the
fastest one to serve. The fastest shape follows the machine's cost curve and the head's
acceptance: with the long recipe's head the fixed chain of 3 with prompt lookup first ran 1.37x
plain decoding where its 32-node trees under the adaptive controller ran ~1.3x on an AMD EPYC, and
on an Intel CPU with AMX (cheap verification) small fixed trees beat every chain (docs/results.md). No model of
costs and acceptance is as reliable as timing the candidates, so :func:`measure_runtime_shape`
does that: each prompt is decoded plainly and with every candidate (greedy, prompt lookup first,
rotating order, one warm-up first). The first candidate listed is the prior: another replaces it
only when its median speed-up is higher *and* it is faster than the first on enough prompts that
chance alone would do so at most 5% of the time (a one-sided sign test; with 6 prompts: all 6). The
best median alone was noise: on one head and machine two repeats on the same 6 MT-bench prompts picked
tree@2/4 (1.21x) and then adaptive (1.12x, tree@2/4 1.06x), and a head whose 6 held-out prompts picked
adaptive by 0.003x over chain@2 ran 1.15x on Spec-Bench where tree@2/4 ran 1.25x (docs/results.md,
thirtieth session).

:func:`~specfoundry.runtime.speculators.checkpoint.set_runtime_shape` stores the result in the
checkpoint (``training.runtime_shape``); ``load_drafter`` then uses that shape, and the generator
its adaptive setting, whenever the caller names no shape. The training evaluation measures it on
its held-out prompts; ``specfoundry tune-shape`` re-measures it on the serving machine (the best
shape is a property of the machine as much as of the head).
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from tqdm import tqdm

from .adaptive import RUNTIME_SHAPE_CANDIDATES, parse_shape_candidate, tree_options

__all__ = ["DEFAULT_CANDIDATES", "SIGN_TEST_P", "choose_candidate", "chosen_candidate", "measure_runtime_shape",
           "shape_label", "sign_test_p"]

DEFAULT_CANDIDATES = RUNTIME_SHAPE_CANDIDATES


#: the sign test's level: a challenger must beat the first candidate on more prompts than chance would
SIGN_TEST_P = 0.05


def chosen_candidate(shape: dict) -> str:
    """The candidate the measurement chose (the stored shape's, unless none beat plain); for a
    shape stored before the choice was recorded, the best median."""
    speedups = shape["speedups"]
    return shape.get("candidate") or max(speedups, key=speedups.get)


def sign_test_p(wins: int, n: int) -> float:
    """One-sided sign test: the chance of ``wins`` or more of ``n`` fair coin flips."""
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n


def choose_candidate(ratios: dict[str, list[float]]) -> str:
    """The first candidate of ``ratios`` (per-prompt speed-ups, every list over the same prompts),
    unless another has a higher median and is faster than it on enough prompts
    (:func:`sign_test_p` <= :data:`SIGN_TEST_P`); of those, the highest median (ties: listed first)."""
    names = list(ratios)
    first = names[0]
    med = {c: statistics.median(r) for c, r in ratios.items()}
    for c in sorted(names[1:], key=lambda c: -med[c]):  # stable: equal medians keep the listed order
        if med[c] <= med[first]:
            break
        wins = sum(a > b for a, b in zip(ratios[c], ratios[first]))
        if sign_test_p(wins, len(ratios[first])) <= SIGN_TEST_P:
            return c
    return first


def shape_label(shape: dict) -> str:
    """The candidate a measured shape came from: ``"adaptive"``, ``"chain@K"`` or ``"tree@K/N"``;
    ``"adaptive (up to chain@K)"`` for the chosen fixed shape stored under the controller because
    it did not beat plain decoding."""
    if shape["adaptive"]:
        speedups = shape.get("speedups") or {}
        chosen = chosen_candidate(shape) if speedups else "adaptive"
        if chosen != "adaptive" and speedups[chosen] < 1.0:
            return f"adaptive (up to {chosen})"
        return "adaptive"
    if shape.get("tree") == "dynamic":
        return f"tree@{shape['depth']}/{shape['total_tokens']}"
    return f"chain@{shape['depth']}"


def _generator(target, speculator, spec: str, prompt_lookup: int):
    from .drafters import load_drafter
    from .drafters.lookup import with_lookup
    from .generator import SpeculativeGenerator

    kind, depth, nodes = parse_shape_candidate(spec)
    if kind == "adaptive":  # the head's natural shape (training.drafter_options), the controller on
        from .speculators.checkpoint import read_config

        saved = (read_config(speculator).get("training") or {}).get("drafter_options") or {}
        drafter = load_drafter(str(speculator), target=target, **saved)
        shape = {**saved, "adaptive": True}
    else:
        options = tree_options(depth, nodes) if kind == "tree" else {"tree": "chain", "depth": depth}
        drafter = load_drafter(str(speculator), target=target, **options)
        shape = {**options, "adaptive": False}
    return SpeculativeGenerator(target, with_lookup(drafter, prompt_lookup), adaptive=shape["adaptive"]), shape


def measure_runtime_shape(target, speculator, prompts: list[str], candidates=DEFAULT_CANDIDATES, *,
                          max_new_tokens: int = 64, prompt_lookup: int = 2, max_minutes: float | None = None,
                          progress: bool = True) -> dict:
    """Time plain decoding and every candidate on ``prompts`` (chat user messages) and return the
    chosen candidate's shape (:func:`choose_candidate`: the first listed unless clearly beaten), as
    ``training.runtime_shape`` stores it::

        {"tree", "depth", ["top_k", "total_tokens"], "adaptive", "speedups": {candidate: median
         speed-up}, "candidate", "prompts", "max_new_tokens", "prompt_lookup", "threads", "dtype", "device"}

    ``max_minutes`` stops starting new prompts once reached (at least one prompt is measured).
    Greedy decoding; the outputs are not compared here (every path is lossless, and the tests
    and the bench check it)."""
    if not prompts:
        raise ValueError("measure_runtime_shape needs at least one prompt")
    candidates = list(dict.fromkeys(candidates))
    if not candidates:
        raise ValueError("measure_runtime_shape needs at least one candidate shape")
    for c in candidates:
        parse_shape_candidate(c)  # every bad spec refused before anything runs
    from .generator import SpeculativeGenerator

    plain = SpeculativeGenerator(target)
    gens = {c: _generator(target, speculator, c, prompt_lookup) for c in candidates}
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, context_overflow="truncate_prompt")
    for gen, _ in gens.values():  # warm-up: lazy setup (cost curve, kernels) stays out of the timing
        gen.generate(prompt=prompts[0], max_new_tokens=4, temperature=0.0, context_overflow="truncate_prompt")
    ratios: dict[str, list[float]] = {c: [] for c in candidates}
    deadline = time.perf_counter() + max_minutes * 60 if max_minutes else None
    for i, prompt in enumerate(tqdm(prompts, desc="runtime shape", disable=not progress, leave=False)):
        if i and deadline and time.perf_counter() > deadline:
            break
        base = plain.generate(prompt=prompt, speculate=False, **kw).stats
        per_token = base.seconds / max(base.new_tokens, 1)
        order = candidates[i % len(candidates):] + candidates[:i % len(candidates)]  # rotate: no fixed slot
        for c in order:
            s = gens[c][0].generate(prompt=prompt, **kw).stats
            ratios[c].append(per_token / (s.seconds / max(s.new_tokens, 1)))
    speedups = {c: statistics.median(r) for c, r in ratios.items()}
    best = choose_candidate(ratios)
    shape = gens[best][1]
    if speedups[best] < 1.0 and not shape["adaptive"]:
        # the chosen shape did not beat plain decoding here: fixed, it would make every request slower, so
        # it becomes the largest shape of the adaptive controller, which steps plainly where
        # drafting does not pay (a speculator that slows decoding is a defect, whatever its tau)
        shape = {**shape, "adaptive": True}
    return {**shape, "speedups": {c: round(v, 4) for c, v in speedups.items()}, "candidate": best,
            "prompts": len(ratios[best]), "max_new_tokens": max_new_tokens, "prompt_lookup": prompt_lookup,
            "threads": torch.get_num_threads(), "dtype": str(target.dtype).removeprefix("torch."),
            "device": str(target.device)}
