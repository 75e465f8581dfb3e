"""Benchmark prompt sets: the built-in set and Spec-Bench / MT-bench / HumanEval / GSM8K files.

Every source becomes a list of :class:`BenchPrompt` (dataset, question id, category, turns).
Accepted JSONL rows (one JSON object per line; lines are split on ``\\n`` only):

- Spec-Bench / MT-bench / EAGLE's HumanEval and GSM8K copies: ``question_id``, ``category``,
  ``turns`` (a list of user turns; ``reference`` and other keys are ignored);
- original HumanEval: ``task_id`` + ``prompt`` (category ``code``);
- original GSM8K: ``question`` (+ ``answer``) (category ``math``);
- a plain ``prompt`` (optional ``category``, ``id``);
- ShareGPT: ``conversations`` (its first human turn).

A ``.json`` file holding a list of such objects is accepted too. Problems are reported as one
line naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BUILTIN = Path(__file__).resolve().parent / "data" / "builtin.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    dataset: str
    question_id: str
    category: str
    turns: tuple[str, ...]

    @property
    def key(self) -> str:
        """``dataset:category``, the row of the per-category tables."""
        return f"{self.dataset}:{self.category}"


def dataset_name(path: Path) -> str:
    """``../spec_bench/question.jsonl`` -> ``spec_bench``; ``gsm8k_test.jsonl`` -> ``gsm8k_test``."""
    if path.resolve() == BUILTIN:
        return "builtin"
    return path.parent.name if path.stem == "question" and path.parent.name else path.stem


def _turns_of(row: dict, where: str) -> tuple[list[str], str | None, str | None]:
    """(turns, default category, id) of one row, or ValueError with a one-line reason."""
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return turns, None, row.get("question_id")
    if "conversations" in row:
        conv = row["conversations"]
        first = conv[0] if isinstance(conv, list) and conv else None
        if not isinstance(first, dict) or first.get("from") != "human" or not str(first.get("value", "")).strip():
            raise ValueError(f"{where}: 'conversations' must start with a non-empty human turn")
        return [first["value"]], "conversation", row.get("id")
    if "task_id" in row and isinstance(row.get("prompt"), str):  # HumanEval
        return [row["prompt"]], "code", row["task_id"]
    if isinstance(row.get("question"), str):  # GSM8K
        return [row["question"]], "math", row.get("id")
    if isinstance(row.get("prompt"), str):
        return [row["prompt"]], None, row.get("id")
    raise ValueError(f"{where}: a row needs 'turns' (Spec-Bench/MT-bench), 'prompt' (HumanEval/plain), "
                     f"'question' (GSM8K) or 'conversations' (ShareGPT); got keys {sorted(row)}")


def _rows(path: Path):
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json prompt file must hold a list of objects")
        yield from ((f"{path}[{i}]", r) for i, r in enumerate(data))
        return
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None


def load_prompts(path: str | Path | None = None) -> list[BenchPrompt]:
    """Prompts of one file (None: the built-in set)."""
    p = BUILTIN if path is None else Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {p} does not exist")
    dataset = dataset_name(p)
    out, seen = [], set()
    for where, row in _rows(p):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each row must be a JSON object, got {type(row).__name__}")
        turns, default_cat, qid = _turns_of(row, where)
        category = row.get("category", default_cat) or "general"
        if not isinstance(category, str) or not category.strip():
            raise ValueError(f"{where}: 'category' must be a non-empty string")
        qid = str(qid) if qid is not None else str(len(out))
        if qid in seen:
            raise ValueError(f"{where}: duplicate question id {qid!r}")
        seen.add(qid)
        out.append(BenchPrompt(dataset, qid, category.strip(), tuple(turns)))
    if not out:
        raise ValueError(f"{p}: no prompts in the file")
    return out


def select(prompts: list[BenchPrompt], categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Keep ``categories`` (a name matches ``category`` or ``dataset:category``), then the first
    ``limit`` prompts of each dataset/category, in file order."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if categories:
        known = {p.category for p in prompts} | {p.key for p in prompts}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                             f"available: {sorted({p.key for p in prompts})}")
        prompts = [p for p in prompts if p.category in categories or p.key in categories]
    counts: dict[str, int] = {}
    kept = []
    for p in prompts:
        if limit is not None and counts.get(p.key, 0) >= limit:
            continue
        counts[p.key] = counts.get(p.key, 0) + 1
        kept.append(p)
    return kept
