"""Weights & Biases tracking through Accelerate's tracker.

Offline unless the user configured an API key (``WANDB_API_KEY`` or a ``wandb login``);
an explicit ``WANDB_MODE`` in the environment always wins. The W&B run directory lives inside
the run directory (``runs/<recipe>/wandb/``), so an offline run can be synced later with
``wandb sync runs/<recipe>/wandb/offline-run-*``.
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_wandb_mode(configured: str | None = None) -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if configured and configured != "auto":
        return configured
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists() and \
        "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if has_key else "offline"


def init_tracking(accelerator, project: str, run_name: str, config: dict, run_dir: Path, mode: str | None = None) -> str:
    """Start the tracker on ``accelerator`` (created with ``log_with="wandb"``); returns the mode."""
    mode = resolve_wandb_mode(mode)
    if mode == "disabled":
        return mode
    os.environ["WANDB_MODE"] = mode
    os.environ.setdefault("WANDB_SILENT", "true")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(project, config=config,
                              init_kwargs={"wandb": {"dir": str(run_dir), "name": run_name, "mode": mode}})
    return mode


def wandb_run_dir(run_dir: Path) -> Path | None:
    """The newest W&B run directory under ``run_dir/wandb``."""
    runs = sorted((Path(run_dir) / "wandb").glob("*run-*"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def read_offline_history(run_path: Path, wait_s: float = 15.0) -> list[dict]:
    """The history rows (``{key: value}``) logged to an offline W&B run, read back from its
    ``run-*.wandb`` file (a LevelDB-style log of protobuf records), so tests and reports can
    check what was really logged without a W&B server. W&B's writer process may still be
    flushing when the run has been finished: the file is re-read until it holds the run's
    ``exit`` record (at most ``wait_s`` seconds)."""
    import time as _time

    deadline = _time.monotonic() + wait_s
    while True:
        rows, complete = _parse_offline_run(run_path)
        if complete or _time.monotonic() > deadline:
            return rows
        _time.sleep(0.1)


def _parse_offline_run(run_path: Path) -> tuple[list[dict], bool]:
    import json as _json

    from wandb.proto import wandb_internal_pb2 as pb

    data = next(Path(run_path).glob("run-*.wandb")).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_path}: not a W&B run file")
    block, pos, pending, rows, complete = 32768, 7, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too short for a header: skip to next block
            pos += block - pos % block
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL / LAST complete it
            rec = pb.Record()
            try:
                rec.ParseFromString(pending)
            except Exception:  # noqa: BLE001 - a record still being written
                break
            which = rec.WhichOneof("record_type")
            if which == "history":
                rows.append({(i.key or "/".join(i.nested_key)): _json.loads(i.value_json) for i in rec.history.item})
            elif which == "exit":
                complete = True
            pending = b""
    return rows, complete
