"""Target hidden states for speculator training: one batch interface, online or offline.

Scope: :class:`HiddenStateSource` turns tokenized examples (``input_ids``, ``loss_mask``; see
:mod:`.data`) into right-padded training batches that carry the frozen target's hidden states:

- ``features`` ``[B, L, F, H]``: HF ``hidden_states`` at ``feature_layers`` (index 0 = the
  embeddings, ``i`` = the input of layer ``i``, ``num_layers`` = the final normed output);
- ``last_hidden`` ``[B, L, H]``: the final normed output (``lm_head(last_hidden)`` gives the
  target's logits, the distillation labels).

``online`` runs the target inside the iterator, i.e. inside the training step that pulls the
batch; ``offline`` precomputes them once (:meth:`HiddenStateSource.prepare`) into sharded
safetensors files with a JSON manifest and memory-maps them back. Both compute each example
with its own unpadded forward (the DESIGN's measured capture mode on CPU, and no padding
compute), so the two modes give bit-identical batches when the storage dtypes match.

Dtypes: the forward runs in the target's dtype. ``dtype`` is what ``features`` are stored and
returned in (bf16 halves the disk); ``last_hidden_dtype`` is kept separate because the labels
should be captured in the dtype the speculator is evaluated against (a bf16 target's argmax
agrees with fp32's on only ~98% of positions).
"""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from specfoundry.runtime.atomic import atomic_file, atomic_write_text

from .data import dtype_name, model_fingerprint, resolve_dtype, stable_hash

FORMAT = "specfoundry-hidden-states-v1"


def dataset_hash(dataset) -> str:
    """Hash of every example's id, tokens and loss mask (what the stored states depend on, plus
    the masks the batches carry). Hashing every token costs a pass over the data, so the result
    is remembered per dataset object (the run names its feature store by it, the store's
    manifest records it: one pass, not two)."""
    return _remembered("hash", dataset, _hash_rows)


def _hash_rows(dataset) -> str:
    import hashlib

    h = hashlib.sha256()
    for i in range(len(dataset)):
        row = dataset[i]
        h.update(str(_example_id(row, i)).encode())
        h.update(np.asarray(row["input_ids"], dtype=np.int64).tobytes())
        h.update(np.asarray(row["loss_mask"], dtype=np.bool_).tobytes())
    return h.hexdigest()[:16]


def _row_lengths(dataset) -> list[int]:
    """Token count of every row (remembered per dataset object: one pass, not one per epoch)."""
    def count(ds):
        column = ds["input_ids"] if hasattr(ds, "column_names") else [r["input_ids"] for r in ds]
        return [len(x) for x in column]

    return _remembered("lengths", dataset, count)


def _remembered(kind: str, dataset, compute):
    """``compute(dataset)``, remembered per dataset object and ``kind`` while the dataset lives."""
    key = (kind, id(dataset))
    ref, n, value = _PER_DATASET.get(key, (None, None, None))
    if ref is not None and ref() is dataset and n == len(dataset):
        return value
    value = compute(dataset)
    try:  # a weak reference: the cache never keeps a dataset alive, and its entry goes with it
        _PER_DATASET[key] = (weakref.ref(dataset, lambda _, k=key: _PER_DATASET.pop(k, None)), len(dataset), value)
    except TypeError:  # a plain list cannot be weakly referenced: computed again each time
        pass
    return value


_PER_DATASET: dict[tuple[str, int], tuple] = {}


def _example_id(row: dict, index: int) -> int:
    return int(row["id"]) if "id" in row and row["id"] is not None else index


def _atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1))


#: batches per length group: shuffled rows are sorted by length within groups of this many
#: batches, so a batch pads to a near-equal length. Random batches of the default recipe padded
#: 35% more positions than they hold (the step is compute-bound); groups of 16 batches: ~3%
LENGTH_GROUP = 16


def batch_order(n: int, batch_size: int, *, seed: int, epoch: int, shuffle: bool = True,
                drop_last: bool = False, lengths=None) -> list[list[int]]:
    """Row indices of every batch of an epoch; a pure function of ``(seed, epoch, lengths)``.

    With ``lengths`` (one per row) and ``shuffle``, the shuffled rows are sorted by length within
    groups of :data:`LENGTH_GROUP` batches and the batches are shuffled again, so batches hold
    rows of similar length (less padding) and their order stays random."""
    if shuffle:
        g = torch.Generator().manual_seed(int(stable_hash("batch-order", seed, epoch)[:12], 16))
        perm = torch.randperm(n, generator=g).tolist()
    else:
        perm = list(range(n))
    if shuffle and lengths is not None:
        if len(lengths) != n:
            raise ValueError(f"lengths has {len(lengths)} entries for {n} rows")
        group = batch_size * LENGTH_GROUP
        perm = [i for s in range(0, n, group) for i in sorted(perm[s:s + group], key=lambda i: -lengths[i])]
    batches = [perm[i:i + batch_size] for i in range(0, n, batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if shuffle and lengths is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def capture_backend(target, capture_batch_size: int) -> str:
    """What runs the offline capture of ``target``: ``"engine"`` (the runtime's, chunked prefill of
    several examples per forward) when the capture is batched and the target decodes on the engine,
    else ``"hf"`` (one unpadded forward per example, or padded batches). The engine's states are the
    ones the drafter reads at inference. Speed (docs/results.md, thirty-first session; 2-core Zen 5
    EPYC, SmolLM2-135M bf16, groups of 8): 1,110-1,240 tok/s against HF's padded batches' 1,030-1,070
    in one process on random tokens, but the default recipe's capture took the same 2:41 either way
    (compute-bound prefill near the CPU's bf16 ceiling in both)."""
    if capture_batch_size > 1 and getattr(target, "backend", "hf") == "engine":
        return "engine"
    return "hf"


class HiddenStateSource:
    """``HiddenStateSource(mode, target, feature_layers, cache_dir=None, dtype=None, ...)``.

    ``mode``: ``"online"`` or ``"offline"`` (needs ``cache_dir``). ``dtype``: storage/return
    dtype of ``features`` (default: the target's). ``last_hidden_dtype``: of ``last_hidden``
    (default: the target's). ``shard_tokens``: tokens per offline shard file. ``device``: where
    batches are returned (default: the target's device). ``online_batched``: run one padded
    forward per batch instead of one per example (faster on a GPU; equal to the offline states
    only up to kernel rounding, not bit for bit). ``capture_batch_size > 1``: the same for the
    offline capture (length-sorted groups; recorded in the manifest header), on the runtime's
    engine where the target decodes on one (:func:`capture_backend`). ``states``: a
    :class:`~specfoundry.train.genstates.GenerationStates` the offline ``prepare`` reads an example's
    states from before capturing it (the self-distillation's own forwards computed them; recorded in
    the header, so such a store is never mixed with a captured-only one).
    """

    def __init__(self, mode: str, target, feature_layers: Sequence[int], cache_dir: str | Path | None = None,
                 dtype=None, *, last_hidden_dtype=None, shard_tokens: int = 32768, device=None,
                 online_batched: bool = False, capture_batch_size: int = 1, states=None):
        if mode not in ("online", "offline"):
            raise ValueError(f"mode must be 'online' or 'offline', got {mode!r}")
        if mode == "offline" and cache_dir is None:
            raise ValueError("offline hidden states need a cache_dir")
        L = target.num_layers
        layers = tuple(int(i) for i in feature_layers)
        if not layers or any(i < 0 or i > L for i in layers):
            raise ValueError(f"feature_layers {feature_layers} must be HF hidden_states indices in [0, {L}]")
        self.mode = mode
        self.target = target
        self.feature_layers = layers
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.dtype = resolve_dtype(dtype) or target.dtype
        self.last_hidden_dtype = resolve_dtype(last_hidden_dtype) or target.dtype
        self.shard_tokens = int(shard_tokens)
        self.device = torch.device(device) if device is not None else target.device
        self.online_batched = bool(online_batched)
        if int(capture_batch_size) < 1:
            raise ValueError(f"capture_batch_size must be >= 1, got {capture_batch_size}")
        self.capture_batch_size = int(capture_batch_size)
        if states is not None and mode != "offline":
            raise ValueError("states from generation fill the offline store; online mode computes every batch")
        self.states = states
        tok = target.tokenizer
        self.pad_id = int(tok.pad_token_id) if tok is not None and tok.pad_token_id is not None else 0
        self._index: dict[int, tuple[int, int, int]] | None = None  # example id -> (shard, offset, length)
        self._handles: dict[int, object] = {}

    # -- the target forward ------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: its tensors could not be saved for the head's backward
    def compute(self, input_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features [n, F, H], last_hidden [n, H])`` of one example, one unpadded forward."""
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.target.device)[None]
        out = self.target.model.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        hs = out.hidden_states
        feats = torch.stack([hs[i][0] for i in self.feature_layers], dim=1).to(self.dtype)
        return feats, out.last_hidden_state[0].to(self.last_hidden_dtype)

    @torch.no_grad()
    def compute_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One right-padded forward: ``(features [B, L, F, H], last_hidden [B, L, H])``."""
        dev = self.target.device
        out = self.target.model.model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev),
                                      use_cache=False, output_hidden_states=True)
        hs = out.hidden_states
        feats = torch.stack([hs[i] for i in self.feature_layers], dim=2).to(self.dtype)
        keep = attention_mask.to(dev).bool()
        feats = feats * keep[..., None, None]  # padded positions are zeros, as in the other paths
        return feats, out.last_hidden_state.to(self.last_hidden_dtype) * keep[..., None]

    # -- batched capture on the engine ------------------------------------------------------
    def _compute_rows_engine(self, rows: list, bar=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``compute`` for each row, ``capture_batch_size`` length-sorted rows per forward of the
        runtime's engine: each row one prefill chunk of its own cache, the products over all rows
        at once (:func:`~specfoundry.runtime.serving.slots.forward_mixed`, as batched generation
        prefills) and no padding. Features are the engine's, which is also what the drafter reads
        at inference; they equal HF's up to kernel rounding."""
        from specfoundry.runtime.serving.slots import SlotCache, forward_mixed

        engine = self.target._engine()
        L = self.target.num_layers
        want = tuple(sorted(set(self.feature_layers) | {L}))  # L: the final normed output
        pick = [want.index(i) for i in self.feature_layers]
        dev = engine.device
        none = torch.zeros(0, 1, dtype=torch.long, device=dev)  # no decode rows, only prefill chunks
        slots = SlotCache(engine, 1, 2)
        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for b in range(0, len(order), self.capture_batch_size):
            idx = order[b:b + self.capture_batch_size]
            chunks = [(engine.new_cache(batch=1, capacity=len(rows[i])),
                       torch.as_tensor(list(rows[i]), dtype=torch.long, device=dev)) for i in idx]
            _, done = forward_mixed(slots, none, none, None, chunks, want)
            for i, (_, f) in zip(idx, done):
                out[i] = (f[0][:, pick].to(self.dtype), f[0][:, want.index(L)].to(self.last_hidden_dtype))
                bar.update(len(rows[i])) if bar is not None else None
        return out

    # -- offline storage -----------------------------------------------------------------------
    def header(self, dataset) -> dict:
        """What the stored states depend on; a manifest with a different header is refused."""
        return {
            "format": FORMAT,
            "target": {**self.target.identity(), "weights": model_fingerprint(self.target),
                       "dtype": dtype_name(self.target.dtype)},
            "feature_layers": list(self.feature_layers),
            "dtype": dtype_name(self.dtype),
            "last_hidden_dtype": dtype_name(self.last_hidden_dtype),
            "shard_tokens": self.shard_tokens,
            "dataset": dataset_hash(dataset),
            "num_examples": len(dataset),
            # batched capture rounds differently from one forward per example (same values up to
            # kernel rounding), so the two are never mixed in one cache; nor the engine's and HF's
            **({"capture_batch_size": self.capture_batch_size} if self.capture_batch_size > 1 else {}),
            **({"capture": "engine"} if self._capture_backend() == "engine" else {}),
            # generation's decode forwards round differently from a capture's prefill (same states
            # up to kernel rounding), so a store filled from them is a store of its own
            **({"states": "generation"} if self.states is not None else {}),
        }

    def _capture_backend(self) -> str:
        return capture_backend(self.target, self.capture_batch_size)

    @property
    def manifest_path(self) -> Path:
        return self.cache_dir / "manifest.json"

    def _read_manifest(self) -> dict | None:
        """The manifest, None when there is none; a corrupt one (not JSON, not an object, no
        header/shards) is a ValueError naming the file."""
        if not self.manifest_path.exists():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.manifest_path}: corrupt hidden-state manifest ({exc})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("header"), dict) \
                or not isinstance(manifest.get("shards"), dict):
            raise ValueError(f"{self.manifest_path}: corrupt hidden-state manifest (no header/shards)")
        return manifest

    def _shard_ok(self, entry, rows: list[int], dataset) -> bool:
        """Whether a listed shard is complete and consistent: its file opens, its tensors hold the
        rows the manifest says (lengths, offsets, example ids of this plan). A shard that is not
        is computed again (it is a cache)."""
        from safetensors import safe_open

        try:
            ids = [_example_id(dataset[i], i) for i in rows]
            lengths = [len(dataset[i]["input_ids"]) for i in rows]
            if [int(x) for x in entry["example_ids"]] != ids or [int(x) for x in entry["lengths"]] != lengths:
                return False
            if [int(o) for o in entry["offsets"]] != np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist():
                return False
            with safe_open(str(self.cache_dir / entry["file"]), framework="pt") as f:
                shapes = {k: f.get_slice(k).get_shape() for k in ("features", "last_hidden")}
            return all(s and s[0] == sum(lengths) for s in shapes.values()) and \
                shapes["features"][1:] == [len(self.feature_layers), self.target.hidden_size]
        except Exception:  # noqa: BLE001 - missing, truncated or tampered: not usable
            return False

    def _check_header(self, manifest: dict, header: dict) -> None:
        diff = [k for k in header if manifest.get("header", {}).get(k) != header[k]]
        if diff:
            details = "; ".join(f"{k}: stored {manifest.get('header', {}).get(k)!r} != {header[k]!r}" for k in diff)
            raise ValueError(f"hidden states in {self.cache_dir} were computed for something else ({details}); "
                             "use another cache_dir or delete it")

    def _shard_plan(self, dataset) -> list[list[int]]:
        """Consecutive examples grouped into shards of about ``shard_tokens`` tokens."""
        plan, cur, tokens = [], [], 0
        for i in range(len(dataset)):
            n = len(dataset[i]["input_ids"])
            if cur and tokens + n > self.shard_tokens:
                plan.append(cur)
                cur, tokens = [], 0
            cur.append(i)
            tokens += n
        if cur:
            plan.append(cur)
        return plan

    def prepare(self, dataset, *, progress: bool = True) -> None:
        """Offline: compute and write every missing shard (resumable: shards already listed in
        the manifest are kept), after checking an existing manifest matches this target, layers,
        dtypes and dataset. Online: nothing to do."""
        if self.mode == "online":
            return
        from safetensors.torch import save_file
        from tqdm.auto import tqdm

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        header = self.header(dataset)
        try:
            manifest = self._read_manifest()
        except ValueError as exc:  # a cache: start it again rather than fail the run
            import warnings

            warnings.warn(f"{exc}; computing the hidden states again", RuntimeWarning, stacklevel=2)
            manifest = None
        if manifest is not None:
            self._check_header(manifest, header)
        else:
            manifest = {"header": header, "shards": {}, "complete": False}
            _atomic_write_json(self.manifest_path, manifest)
        plan = self._shard_plan(dataset)
        todo = [s for s in range(len(plan)) if not self._shard_ok(manifest["shards"].get(str(s)), plan[s], dataset)]
        total = sum(len(dataset[i]["input_ids"]) for s in todo for i in plan[s])
        bar = tqdm(total=total, desc="hidden states", unit="tok", disable=not progress or not todo)
        for s in todo:
            feats, lasts, ids, lengths = [], [], [], []
            for i, (f, h) in zip(plan[s], self._rows_of(dataset, plan[s], bar)):
                feats.append(f.cpu())
                lasts.append(h.cpu())
                ids.append(_example_id(dataset[i], i))
                lengths.append(f.shape[0])
            name = f"shard-{s:05d}.safetensors"
            tensors = {"features": torch.cat(feats).contiguous(), "last_hidden": torch.cat(lasts).contiguous()}
            with atomic_file(self.cache_dir / name) as tmp:  # a shard exists only once complete
                save_file(tensors, tmp, metadata={"format": FORMAT, "target": header["target"]["weights"]})
            offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
            manifest["shards"][str(s)] = {
                "file": name, "example_ids": ids, "lengths": lengths, "offsets": [int(o) for o in offsets],
                "shapes": {k: list(v.shape) for k, v in tensors.items()},
                "dtype": {k: dtype_name(v.dtype) for k, v in tensors.items()},
            }
            manifest["complete"] = len(manifest["shards"]) == len(plan)
            _atomic_write_json(self.manifest_path, manifest)
        bar.close()
        manifest["complete"] = True
        _atomic_write_json(self.manifest_path, manifest)
        self._index = None

    def _rows_of(self, dataset, rows: list[int], bar=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """States of ``dataset``'s ``rows``: read from ``self.states`` where generation kept them, the
        rest captured (:meth:`_compute_rows`)."""
        got: list = [None] * len(rows)
        if self.states is not None:
            for k, i in enumerate(rows):
                row = dataset[i]
                kept = self.states.get(row["prompt"], row["input_ids"]) if row.get("prompt") is not None else None
                if kept is not None:
                    got[k] = (kept[0].to(self.dtype), kept[1].to(self.last_hidden_dtype))
                    bar.update(len(row["input_ids"])) if bar is not None else None
        todo = [k for k in range(len(rows)) if got[k] is None]
        for k, fh in zip(todo, self._compute_rows([dataset[rows[k]]["input_ids"] for k in todo], bar) if todo else []):
            got[k] = fh
        return got

    def _compute_rows(self, rows: list, bar=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``compute`` for each row, in order; with ``capture_batch_size > 1`` rows of similar
        length share one right-padded forward (measured ~2.2x the per-example rate on 2 CPU cores)."""
        if self._capture_backend() == "engine":
            return self._compute_rows_engine(rows, bar)
        if self.capture_batch_size == 1:
            out = []
            for r in rows:
                out.append(self.compute(r))
                bar.update(len(r)) if bar is not None else None
            return out
        out: list = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        for b in range(0, len(order), self.capture_batch_size):
            idx = order[b:b + self.capture_batch_size]
            L = max(len(rows[i]) for i in idx)
            ids = torch.full((len(idx), L), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(idx), L, dtype=torch.long)
            for k, i in enumerate(idx):
                ids[k, :len(rows[i])] = torch.as_tensor(list(rows[i]), dtype=torch.long)
                mask[k, :len(rows[i])] = 1
            f, h = self.compute_batch(ids, mask)
            for k, i in enumerate(idx):
                n = len(rows[i])
                out[i] = (f[k, :n], h[k, :n])
                bar.update(n) if bar is not None else None
        return out

    def _load_index(self, dataset) -> None:
        manifest = self._read_manifest()
        if manifest is None or not manifest.get("complete"):
            raise RuntimeError(f"no complete hidden states in {self.cache_dir}: call prepare(dataset) first")
        self._check_header(manifest, self.header(dataset))
        from safetensors import safe_open

        self._index, self._handles = {}, {}
        for s, entry in manifest["shards"].items():
            self._handles[int(s)] = safe_open(str(self.cache_dir / entry["file"]), framework="pt")
            for eid, off, n in zip(entry["example_ids"], entry["offsets"], entry["lengths"]):
                self._index[int(eid)] = (int(s), off, n)

    def _stored(self, eid: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, off, n = self._index[eid]
        f = self._handles[s]
        return f.get_slice("features")[off:off + n], f.get_slice("last_hidden")[off:off + n]

    # -- batches -------------------------------------------------------------------------------
    def num_batches(self, dataset, batch_size: int, *, drop_last: bool = False, world_size: int = 1) -> int:
        n = len(dataset) // batch_size if drop_last else math.ceil(len(dataset) / batch_size)
        return math.ceil(n / world_size) if world_size > 1 else n

    def batches(self, dataset, batch_size: int, *, seed: int, epoch: int, start_step: int = 0,
                shuffle: bool = True, drop_last: bool = False, rank: int = 0,
                world_size: int = 1) -> Iterator[dict]:
        """Right-padded batches of one epoch in a deterministic order (``seed``, ``epoch``);
        the first ``start_step`` batches are skipped without computing anything (resume). With
        ``world_size > 1`` process ``rank`` gets every ``world_size``-th batch.

        Each batch: ``input_ids`` [B, L] long, ``attention_mask`` [B, L] long, ``loss_mask``
        [B, L] bool, ``features`` [B, L, F, H], ``last_hidden`` [B, L, H], ``example_ids`` [B].
        """
        if self.mode == "offline":
            self._load_index(dataset)
        lengths = _row_lengths(dataset) if shuffle else None
        order = batch_order(len(dataset), batch_size, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last,
                            lengths=lengths)
        mine = order[rank::world_size]
        for rows_idx in mine[start_step:]:
            rows = [dataset[i] for i in rows_idx]
            yield self._collate(rows, rows_idx)

    def _collate(self, rows: list[dict], rows_idx: list[int]) -> dict:
        B = len(rows)
        Lmax = max(len(r["input_ids"]) for r in rows)
        F, H = len(self.feature_layers), self.target.hidden_size
        dev = self.device
        input_ids = torch.full((B, Lmax), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(B, Lmax, dtype=torch.long)
        loss_mask = torch.zeros(B, Lmax, dtype=torch.bool)
        features = torch.zeros(B, Lmax, F, H, dtype=self.dtype, device=dev)
        last_hidden = torch.zeros(B, Lmax, H, dtype=self.last_hidden_dtype, device=dev)
        ids = []
        batched = self.mode == "online" and self.online_batched
        for b, (row, i) in enumerate(zip(rows, rows_idx)):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[b, :n] = 1
            loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.bool)
            eid = _example_id(row, i)
            ids.append(eid)
            if batched:
                continue
            f, h = self._stored(eid) if self.mode == "offline" else self.compute(row["input_ids"])
            features[b, :n] = f.to(dev)
            last_hidden[b, :n] = h.to(dev)
        if batched:
            f, h = self.compute_batch(input_ids, attention_mask)
            features, last_hidden = f.to(dev), h.to(dev)
        return {"input_ids": input_ids.to(dev), "attention_mask": attention_mask.to(dev),
                "loss_mask": loss_mask.to(dev), "features": features, "last_hidden": last_hidden,
                "example_ids": torch.tensor(ids, dtype=torch.long)}
