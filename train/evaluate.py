"""Measured tau of a trained speculator: real speculative decoding on held-out prompt sets, at
each temperature, interleaved with plain decoding for the wall-clock ratio."""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from specfoundry.runtime import SpeculativeGenerator
from specfoundry.runtime.lossless import compare_greedy
from specfoundry.runtime.tau import summarize_tau

BUILTIN_HELDOUT = "builtin-heldout"


def evaluate_speculator(target, drafter, prompt_sets: dict[str, list[str]], *, temperatures=(0.0, 1.0),
                        max_new_tokens: int = 128, depth: int = 5, baseline: bool = True,
                        max_minutes: float | None = None, seed: int = 0, adaptive: bool = True) -> dict:
    """``{set: {"T=<t>": {tau, acceptance_by_position, speedup, n, planned; at T=0 identical_rate,
    near_ties, lossless_failures}}}`` (see :func:`~specfoundry.runtime.lossless.compare_greedy`).

    ``planned`` is the number of prompts given for the set, ``n`` the number measured. ``max_minutes``
    is a guard over the whole evaluation, shared out evenly over the cells (set x temperature; time a
    cell leaves unused goes to the later ones): past its share no new prompt of a cell starts, and every cell it cut
    short carries ``stopped_by_guard: True`` and ``incomplete: "<n>/<planned> prompts (...)"``; a
    cell the guard reached before its first prompt is still listed, with ``n: 0`` and ``tau: None``
    (never silently left out)."""
    gen = SpeculativeGenerator(target, drafter, max_depth=depth, adaptive=adaptive)
    deadline = time.perf_counter() + max_minutes * 60 if max_minutes else None
    out: dict = {}
    cells_left = len(prompt_sets) * len(temperatures)
    for name, prompts in prompt_sets.items():
        out[name] = {}
        for t in temperatures:
            runs, ratios, ident = [], [], []
            # each cell gets an equal share of the time left (what a quick cell leaves passes on):
            # a slow machine once spent the whole budget on the first prompt set, leaving MT-bench at 0
            now = time.perf_counter()
            cell_end = deadline and now + (deadline - now) / cells_left
            cells_left -= 1
            for i, prompt in enumerate(tqdm(prompts, desc=f"eval {name} T={t}", leave=False)):
                if deadline and time.perf_counter() > cell_end:
                    break
                # a held-out prompt longer than the target's context keeps its last tokens (measured,
                # not a failed run at the end of training)
                kw = dict(prompt=prompt, max_new_tokens=max_new_tokens, temperature=t, seed=seed + i,
                          context_overflow="truncate_prompt")
                spec = gen.generate(**kw)
                runs.append(spec.stats)
                if baseline:
                    plain = gen.generate(speculate=False, **kw)
                    ratios.append(plain.stats.seconds / spec.stats.seconds)
                    if t == 0:
                        ident.append(compare_greedy(target, spec.prompt_ids, spec.token_ids, plain.token_ids))
            cut = len(runs) < len(prompts)  # only the deadline ends a cell early
            why = {"stopped_by_guard": True,
                   "incomplete": f"{len(runs)}/{len(prompts)} prompts (evaluation.max_minutes={max_minutes:g} reached)"
                   } if cut else {}
            if not runs:
                out[name][f"T={t:g}"] = {"n": 0, "planned": len(prompts), "tau": None, **why}
                continue
            summary = summarize_tau(runs)  # the one definition of tau (pooled) the bench uses too
            entry = {"n": summary["n"], "planned": len(prompts), **why, "tau": summary["tau"],
                     "tau_min": summary["tau_min"], "tau_median": summary["tau_median"], "tau_max": summary["tau_max"],
                     "acceptance_by_position": summary["acceptance_by_position"]}
            if ratios:
                entry["speedup"] = statistics.median(ratios)
            if ident:  # exact equality; rounding near-ties (bf16) and real failures counted apart
                entry["identical_rate"] = sum(c.identical for c in ident) / len(ident)
                entry["near_ties"] = sum(c.near_tie for c in ident)
                entry["lossless_failures"] = sum(not c.ok for c in ident)
            out[name][f"T={t:g}"] = entry
    return out
