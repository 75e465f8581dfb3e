"""Identities and the content-addressed cache of the training data.

Scope: :func:`stable_hash` and :func:`model_fingerprint` (what cache keys are made of), the
dtype names the caches record (:func:`resolve_dtype`, :func:`dtype_name`), :class:`GenStats`
(token counts and time of generation), and :func:`cached_chunks`: computing a list chunk by
chunk into ``datasets`` shards named by the hash of what determines them, so a killed run
resumes where it stopped and a changed input recomputes only the chunks that changed (or, keyed
by item, only the items never computed). Shards
are written through the one atomic directory writer (:mod:`specfoundry.runtime.atomic`).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specfoundry.runtime.atomic import atomic_dir

__all__ = ["stable_hash", "model_fingerprint", "resolve_dtype", "dtype_name", "GenStats", "ChunkReport",
           "cached_chunks", "save_dataset_atomic"]


def stable_hash(*parts) -> str:
    """sha256 over the JSON of ``parts`` (sorted keys), hex."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str, ensure_ascii=False).encode())
        h.update(b"\x00")
    return h.hexdigest()


def model_fingerprint(target) -> str:
    """Identity of a target for data caches: the runtime's weights fingerprint plus its config."""
    h = hashlib.sha256(target.fingerprint().encode())
    h.update(target.config.to_json_string(use_diff=False).encode() if hasattr(target.config, "to_json_string") else b"")
    return h.hexdigest()[:16]


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}
    if str(dtype) not in names:
        raise ValueError(f"unknown dtype {dtype!r} (use one of {sorted(names)})")
    return names[str(dtype)]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class GenStats:
    """Token counts and wall time of generation calls (for throughput reports)."""

    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: "GenStats") -> None:
        self.prompts += other.prompts
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds

    @property
    def new_tok_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (f"{self.prompts} prompts, {self.prompt_tokens} prompt + {self.new_tokens} new tokens in "
                f"{self.seconds:.1f}s: {self.new_tok_per_s:.0f} new tok/s, "
                f"{(self.prompt_tokens + self.new_tokens) / max(self.seconds, 1e-9):.0f} total tok/s")


def save_dataset_atomic(ds, out: Path) -> None:
    """``ds.save_to_disk`` into a temporary sibling swapped in by :func:`~specfoundry.runtime.atomic.atomic_dir`:
    ``out`` exists only complete. (``datasets``' own per-save progress bars are muted: one chunk
    is not worth a bar.) ``out`` is a content-addressed cache entry, so an existing one is ours."""
    import datasets

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with atomic_dir(out, lambda p: True, "a dataset cache entry") as tmp:
            ds.save_to_disk(str(tmp))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


@dataclass
class ChunkReport:
    computed: int = 0
    reused: int = 0
    skipped: int = 0  # not computed: it would have ended past the deadline
    stats: GenStats = field(default_factory=GenStats)
    last_seconds: float = 0.0  # wall time of the last chunk computed (the next one's estimate)
    last_items: int = 0  # items in that chunk (with item_column, a cut chunk is sized by seconds per item)
    items_reused: int = 0  # with item_column: items taken from shards of earlier chunkings
    cut: tuple[int, int] | None = None  # with item_column: (items computed, items in the chunk) of a chunk cut to the deadline


def cached_chunks(root: Path | None, items: list, chunk_size: int, key_base: dict,
                  compute: Callable[[list, int], dict[str, list]], desc: str = "chunks",
                  report: ChunkReport | None = None, deadline: float | None = None, item_column: str | None = None):
    """Apply ``compute(chunk, seed) -> columns`` to ``items`` chunk by chunk, saving each chunk as a
    ``datasets`` shard in ``root/chunk-<hash>`` (hash of ``key_base`` + the chunk's items). Done
    chunks are loaded instead of recomputed, so an interrupted run resumes; a shard appears by an
    atomic rename only once it is complete. ``root=None`` computes without caching. A new chunk
    starts only while it is expected to end by ``deadline`` (a ``time.time()`` value; the estimate
    is ``report.last_seconds``, the previous chunk's time, so pass one report across calls whose
    chunks cost alike); cached ones are still used.
    ``item_column``: the column that holds each row's item (one row per item); then any item found
    in any done shard under ``root`` is reused whatever chunk it was computed in, and only the
    others are chunked and computed, so a list that grew, shrank or moved keeps its done rows
    (positional chunks alone would recompute every chunk after the first change). Keyed by item, the
    chunk that would end past ``deadline`` is cut to the items expected to fit (seconds per item of
    the last chunk, :data:`CUT_SAFETY` of the time left, at least an eighth of the chunk, else skipped;
    ``report.cut``) and no chunk starts after it.
    Returns the concatenated ``datasets.Dataset`` of the chunks available (None if none); with
    ``item_column``, one row per available item in ``items``' order."""
    from datasets import Dataset, concatenate_datasets, load_from_disk
    from tqdm.auto import tqdm

    report = report if report is not None else ChunkReport()
    parts = []
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    shards: list = []  # with item_column: the done shards under root, then the ones made now
    done: dict = {}  # item -> (its shard's index in shards, row)
    if root is not None and item_column is not None:
        for d in sorted(root.glob("chunk-*")):
            if (d / "dataset_info.json").exists():
                _index(shards, done, load_from_disk(str(d)), item_column)
    n_old = len(shards)
    todo = [x for x in items if x not in done] if done else items
    chunks = [todo[i:i + chunk_size] for i in range(0, len(todo), chunk_size)]
    for chunk in tqdm(chunks, desc=desc, unit="chunk", disable=len(chunks) <= 1):
        key = stable_hash(key_base, chunk)
        d = root / f"chunk-{key[:20]}" if root is not None else None
        cached = d is not None and (d / "dataset_info.json").exists()
        # (a guard that only stops starting chunks overran the default recipe's data budget by a
        # whole 80-s chunk on a slow machine)
        if not cached and deadline is not None and (report.cut or time.time() + report.last_seconds > deadline):
            n = _items_that_fit(report, deadline, len(chunk)) if item_column is not None and not report.cut else 0
            if not n:
                report.skipped += 1
                continue
            if n < len(chunk):
                # skipping the whole chunk left up to a chunk's time unused: the default recipe's third
                # response chunk (93 s) was skipped with 66 s left on a 2-core Xeon without AMX
                report.cut = (n, len(chunk))
                chunk = chunk[:n]
                key = stable_hash(key_base, chunk)
                d = root / f"chunk-{key[:20]}" if root is not None else None
        if not cached:
            t0 = time.perf_counter()
            cols = compute(chunk, int(key[:8], 16))
            report.last_seconds = time.perf_counter() - t0
            report.last_items = len(chunk)
            report.computed += 1
        if root is None:  # no cache: kept in memory
            parts.append(Dataset.from_dict(cols))
            continue
        if not cached:
            save_dataset_atomic(Dataset.from_dict(cols), d)
        else:
            report.reused += 1
        parts.append(load_from_disk(str(d)))
    if done:
        for ds in parts:
            _index(shards, done, ds, item_column)
        return _gather(items, shards, done, n_old, report)
    if not parts:
        return None
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


#: the share of the time left that a chunk cut to the deadline is sized to fill: its estimate (seconds per item
#: of the last chunk) misses the tail of its longest item, which a smaller chunk shares among fewer items
CUT_SAFETY = 0.8


def _items_that_fit(report: ChunkReport, deadline: float, size: int) -> int:
    """How many of a chunk's ``size`` items are expected to end by ``deadline``, 0 when fewer than an eighth
    of it (or when no chunk was timed yet)."""
    if not report.last_items:
        return 0
    n = min(size, int(CUT_SAFETY * (deadline - time.time()) * report.last_items / max(report.last_seconds, 1e-6)))
    return n if n >= max(1, size // 8) else 0


def _index(shards: list, found: dict, ds, column: str) -> None:
    """Append ``ds`` to ``shards`` and map each of its items to (that index, row); the first shard wins."""
    shards.append(ds)
    for row, item in enumerate(ds[column]):
        found.setdefault(item, (len(shards) - 1, row))


def _gather(items: list, shards: list, found: dict, n_old: int, report: ChunkReport):
    """One row per item of ``items`` found in ``shards`` (those of a chunk the deadline skipped are not), in
    ``items``' order; the first ``n_old`` shards are the reused ones."""
    from datasets import concatenate_datasets

    picked = [found[x] for x in items if x in found]
    report.items_reused += sum(1 for s, _ in picked if s < n_old)
    report.reused += len({s for s, _ in picked if s < n_old})
    if not picked:
        return None
    used = sorted({s for s, _ in picked})
    offset, start = 0, {}
    for s in used:
        start[s], offset = offset, offset + len(shards[s])
    parts = [shards[s] for s in used]
    return (concatenate_datasets(parts) if len(parts) > 1 else parts[0]).select([start[s] + r for s, r in picked])
