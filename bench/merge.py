"""``specfoundry bench --merge DIR DIR ... --out DIR``: one report from several bench runs.

A full Spec-Bench pass with every method takes hours of one core, so it is run in parts (by
category or temperature, one process per core) and merged. Every speed-up is a ratio within
one prompt of one run (the method against plain decoding of the same prompt, interleaved),
so pooling the records of runs keeps each ratio honest; the merge therefore insists that the
parts measured the same thing: the same methods (name, label, draft depth, check), the same
target, dtype, token budget, seed, repeats, EOS rule, device and threads, and no prompt
measured twice. The parts' environments and timestamps are kept under ``parts``.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from .report import SCHEMA_ID, validate_report

# settings that must agree across parts (the rest — temperatures, datasets, categories, prompt counts — are pooled)
SAME_SETTINGS = ("target", "dtype", "max_new_tokens", "repeats", "seed", "stop_at_eos", "device", "runs", "limit")
SAME_ENVIRONMENT = ("python", "torch", "transformers", "platform", "machine", "torch_threads")
METHOD_KEYS = ("name", "label", "kind", "draft_depth", "interleaved", "check", "reference")


def _load(d: Path) -> dict:
    path = Path(d) / "report.json"
    if not path.is_file():
        raise ValueError(f"--merge: no report.json in {d}")
    report = json.loads(path.read_text())
    problems = validate_report(report)
    if problems:
        raise ValueError(f"--merge: {path} is not a valid report: {problems[0]}")
    return report


def _record_key(r: dict) -> tuple:
    return (r["temperature"], r["repeat"], r["dataset"], r["question_id"], r["turn"], r["method"])


def merge_reports(dirs: list[Path]) -> dict:
    """The merged report (summary not yet computed); ValueError naming the first disagreement."""
    if len(dirs) < 2:
        raise ValueError("--merge needs at least two report directories")
    parts = [_load(d) for d in dirs]
    first, d0 = parts[0], dirs[0]
    methods0 = [{k: m.get(k) for k in METHOD_KEYS} for m in first["methods"]]
    for d, rep in zip(dirs[1:], parts[1:]):
        for key in SAME_SETTINGS:
            if rep["settings"].get(key) != first["settings"].get(key):
                raise ValueError(f"--merge: {d} has {key}={rep['settings'].get(key)!r}, "
                                 f"{d0} has {first['settings'].get(key)!r}")
        for key in SAME_ENVIRONMENT:
            if rep["environment"].get(key) != first["environment"].get(key):
                raise ValueError(f"--merge: {d} ran with {key}={rep['environment'].get(key)!r}, "
                                 f"{d0} with {first['environment'].get(key)!r}")
        methods = [{k: m.get(k) for k in METHOD_KEYS} for m in rep["methods"]]
        if methods != methods0:
            a, b = [m["name"] for m in methods], [m["name"] for m in methods0]
            diff = next((x for x, y in zip(methods, methods0) if x != y), None) if a == b else None
            raise ValueError(f"--merge: {d} measured other methods than {d0}: "
                             + (f"{a} vs {b}" if a != b else f"{diff['name']!r} differs ({diff} vs its namesake)"))
    seen: dict[tuple, Path] = {}
    records = []
    for d, rep in zip(dirs, parts):
        for r in rep["records"]:
            k = _record_key(r)
            if k in seen:
                raise ValueError(f"--merge: {k[2]}:{k[3]} turn {k[4]} ({k[5]}, T={k[0]:g}) is in both {seen[k]} and {d}")
            seen[k] = d
            records.append(r)
    unavailable = {}
    for rep in parts:
        for u in rep["unavailable"]:
            unavailable.setdefault(u["name"], u)
    settings = dict(first["settings"])
    settings.update({
        "temperatures": sorted({t for rep in parts for t in rep["settings"]["temperatures"]}),
        "datasets": sorted({x for rep in parts for x in rep["settings"]["datasets"]}),
        "categories": sorted({x for rep in parts for x in rep["settings"].get("categories", [])}),
        "prompts": sum(rep["settings"].get("prompts", 0) for rep in parts),
        "turns": sum(rep["settings"].get("turns", 0) for rep in parts)})
    commits = list(dict.fromkeys(rep["environment"]["git_commit"] for rep in parts))
    environment = dict(first["environment"], git_commit="+".join(commits))
    return {"schema": SCHEMA_ID, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "passed": True,
            "environment": environment, "settings": settings, "methods": first["methods"],
            "unavailable": list(unavailable.values()), "errors": [e for rep in parts for e in rep["errors"]],
            "seconds": sum(rep["seconds"] for rep in parts), "records": records, "summary": {}, "failures": [],
            "files": {}, "parts": [{"dir": str(d), "created": rep["created"], "git_commit": rep["environment"]["git_commit"],
                                    "seconds": rep["seconds"], "categories": rep["settings"].get("categories", []),
                                    "temperatures": rep["settings"]["temperatures"]} for d, rep in zip(dirs, parts)]}
