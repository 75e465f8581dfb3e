"""Planned vs done per stage of a training run, and the one line the CLI ends with.

Scope: building the ``stages`` block of ``train_summary.json`` from what each stage reports
(:func:`data_stage`, :func:`capture_stage`, :func:`training_stage`, :func:`evaluation_stage`)
and :func:`guard_line`, the sentence that says which stages a minute guard (``max_minutes``)
stopped. A recipe's data size, epochs and evaluation prompt counts are the plan; the minute
budgets only guard it, so a stage they cut short is recorded and reported, never silent.

Every stage is ``{"unit", "planned", "done", "stopped_by_guard", "guard"}`` (``guard``: the
recipe field and value, e.g. ``"data.max_minutes=8"``, or None when the stage has no guard);
the evaluation stage holds one such entry per measured cell under ``cells``.
"""

from __future__ import annotations

__all__ = ["data_stage", "capture_stage", "training_stage", "evaluation_stage", "guard_line", "stopped_stages"]


def _guard(field: str, minutes) -> str | None:
    return f"{field}={minutes:g}" if minutes else None


def data_stage(stats: dict, max_minutes) -> dict:
    """From :func:`~specfoundry.train.data.build_dataset`'s ``stats``: planned = the training
    examples the prompt sources ask for (their counts/limits less the held-out prompts; the
    prompts found when a source has no limit), done = examples in the dataset."""
    asked = stats.get("prompts_asked")
    planned = (asked if asked is not None else stats.get("prompts", 0)) - stats.get("held_out", 0)
    return {"unit": "examples", "planned": max(planned, 0), "done": stats.get("examples", 0),
            "stopped_by_guard": bool(stats.get("stopped_by_guard")), "guard": _guard("data.max_minutes", max_minutes),
            "prompts": stats.get("prompts"), "held_out": stats.get("held_out"),
            "chunks_skipped": stats.get("chunks_skipped", 0)}


def capture_stage(mode: str, sequences: int, from_generation: int | None = None) -> dict:
    """Hidden-state capture has no minute guard: offline, every sequence's states are written
    before training starts (or the run fails); online, they are computed inside each step.
    ``from_generation``: of those, how many the store read from the states self-distillation kept
    (train/genstates.py) instead of capturing them (None where it does not read any)."""
    return {"unit": "sequences", "mode": mode, "planned": sequences, "done": sequences,
            "stopped_by_guard": False, "guard": None,
            **({"from_generation": from_generation} if from_generation is not None else {})}


def training_stage(planned_steps: int, summary: dict, max_minutes) -> dict:
    """planned = the steps the recipe's epochs / max_steps give; done = optimizer steps taken.
    The guard stopped it when the loop ran out of time or fitted its schedule to fewer steps."""
    done = int(summary.get("global_step", 0))
    fitted = int(summary.get("max_steps") or planned_steps)
    stopped = bool(summary.get("stopped_by_time")) or (done < planned_steps and fitted < planned_steps)
    return {"unit": "steps", "planned": int(planned_steps), "done": done, "stopped_by_guard": stopped,
            "guard": _guard("training.max_minutes", max_minutes)}


def evaluation_stage(measured: dict, asked: dict[str, int], max_minutes) -> dict:
    """One entry per ``(set, temperature)`` cell: planned = the prompts the recipe asked for
    (``evaluation.limit``), done = prompts measured. ``short_of_prompts``: the set had fewer
    prompts than asked (not the guard, but also marked)."""
    cells = {}
    for name, per in measured.items():
        for t, entry in per.items():
            cell = {"unit": "prompts", "planned": int(asked.get(name, entry.get("planned", 0))),
                    "done": int(entry.get("n", 0)), "stopped_by_guard": bool(entry.get("stopped_by_guard")),
                    "guard": _guard("evaluation.max_minutes", max_minutes)}
            if entry.get("planned", cell["planned"]) < cell["planned"]:
                cell["short_of_prompts"] = f"the set holds {entry['planned']} of the {cell['planned']} prompts asked"
            cells[f"{name} {t}"] = cell
    return {"unit": "prompts", "cells": cells,
            "stopped_by_guard": any(c["stopped_by_guard"] for c in cells.values()),
            "guard": _guard("evaluation.max_minutes", max_minutes)}


def _why(stage: dict) -> str:
    return f" ({stage['guard']})" if stage.get("guard") else ""


def stopped_stages(stages: dict) -> list[str]:
    """``"<stage> <done>/<planned> <unit> (<guard>)"`` for every stage (evaluation: cell) the
    guard stopped, and the evaluation cells measured on fewer prompts than asked."""
    out = []
    for name in ("data", "capture", "training"):
        st = stages.get(name)
        if st and st.get("stopped_by_guard"):
            out.append(f"{name} {st['done']}/{st['planned']} {st['unit']}" + _why(st))
    ev = stages.get("evaluation") or {}
    for cell, st in (ev.get("cells") or {}).items():
        if st.get("stopped_by_guard"):
            out.append(f"evaluation {cell} {st['done']}/{st['planned']} prompts" + _why(st))
        elif st["done"] < st["planned"]:
            out.append(f"evaluation {cell} {st['done']}/{st['planned']} prompts (fewer in the set)")
    return out


def guard_line(stages: dict | None) -> str:
    """The one line ``specfoundry train`` ends with."""
    if not stages:
        return "[train] WARNING: the run summary records no stages (planned vs done unknown)"
    stopped = stopped_stages(stages)
    if not stopped:
        return "[train] all stages ran as planned"
    n_guard = len({s.split()[0] for s in stopped if not s.endswith("(fewer in the set)")})
    head = f"guards stopped {n_guard} stage{'s' if n_guard > 1 else ''}" if n_guard else "short of plan"
    return f"[train] WARNING: {head}: " + ", ".join(stopped)
