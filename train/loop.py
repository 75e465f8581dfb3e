"""The one training loop (plain PyTorch + Accelerate): steps, logging, checkpoints, resume.

The method is an ``nn.Module`` whose ``forward(batch)`` returns ``(loss, metrics)``; the loop
knows nothing about EAGLE or Medusa. It runs unchanged under ``accelerate launch`` with a
single process, DDP or DeepSpeed ZeRO-2/3 (the launcher config decides).

Checkpoints (every ``checkpoint_every`` steps and at the end) are written atomically: the
Accelerate state (model, optimizer, scheduler, RNG of every process) plus ``trainer_state.json``
(global step, epoch, step within the epoch) go to a temp directory that is renamed into
``checkpoints/step-XXXXXXX``. ``resume=True`` restores the newest *valid* checkpoint of this
run and skips the batches already consumed, so the data order continues exactly.

A run directory belongs to one run: ``run.json`` records its id, every checkpoint records it
too, and a resume only considers checkpoints of that id. A checkpoint that cannot be restored
completely (unreadable files, a tampered RNG state, non-finite weights or optimizer state) is
passed over with a warning for the previous one; when none is left, resuming is an error.
Training stops at the first non-finite loss or gradient norm with :class:`NonFiniteError`
(``LoopConfig.max_nonfinite_skips`` > 0 skips and counts up to that many such steps instead).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from specfoundry.runtime.atomic import atomic_write_text, replace_dir


@dataclass
class LoopConfig:
    max_steps: int
    max_minutes: float | None = None
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    scheduler: str = "cosine"  # cosine | linear | constant
    grad_clip: float | None = 0.5
    log_every: int = 10
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    micro_batch_size: int = 1  # per process; fills DeepSpeed's "auto" (we feed batches, not a DataLoader)
    eval_every: int = 0  # run ``evaluate`` every N steps (0: never mid-run)
    # steps with a non-finite loss or gradient that may be skipped (and counted) before the run
    # stops; 0: the first one stops it
    max_nonfinite_skips: int = 0

    def __post_init__(self):
        """One sentence per bad value (a zero ``log_every`` would be a ZeroDivisionError mid-run)."""
        def integer(name, lo):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")

        def real(name, lo, allow_none=False, open_lo=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or (v <= lo if open_lo else v < lo):
                raise ValueError(f"{name} must be a finite number {'>' if open_lo else '>='} {lo}, got {v!r}")

        for name, lo in (("max_steps", 1), ("warmup_steps", 0), ("log_every", 1), ("checkpoint_every", 0),
                         ("keep_checkpoints", 0), ("micro_batch_size", 1), ("eval_every", 0),
                         ("max_nonfinite_skips", 0)):
            integer(name, lo)
        real("learning_rate", 0.0)
        real("weight_decay", 0.0)
        real("grad_clip", 0.0, allow_none=True)
        real("max_minutes", 0.0, allow_none=True)
        if self.scheduler not in ("cosine", "linear", "constant"):
            raise ValueError(f"scheduler must be cosine, linear or constant, got {self.scheduler!r}")


class NonFiniteError(ValueError):
    """Training produced (or a checkpoint holds) a non-finite value."""


class RunDirError(ValueError):
    """A run directory that this run may not use as asked (another run's, a file, not ours)."""


class ResumeError(ValueError):
    """``--resume`` found no checkpoint of this run that can be restored completely."""


RUN_FILE = "run.json"
# what a run writes into its directory: a directory holding only these (or nothing) is a run
# directory ``--overwrite`` may clear
_RUN_ENTRIES = {RUN_FILE, "checkpoints", "recipe.resolved.yaml", "speculator", "train_summary.json", "wandb",
                "export", "target", "adapter"}


def _ours(name: str) -> bool:
    """An entry a run writes, or the leftover of one of its atomic writes (``.speculator.x.tmp``)."""
    return name in _RUN_ENTRIES or any(name.startswith(f".{e}.") or name.startswith(f".tmp-{e}") for e in _RUN_ENTRIES)


def _is_run_dir(run_dir: Path) -> bool:
    return (run_dir / RUN_FILE).is_file() or (run_dir / "checkpoints").is_dir() \
        or (run_dir / "recipe.resolved.yaml").is_file()


def read_run_id(run_dir: Path) -> str | None:
    f = Path(run_dir) / RUN_FILE
    if not f.is_file():
        return None
    try:
        rid = json.loads(f.read_text()).get("run_id")
    except (ValueError, AttributeError, UnicodeDecodeError):
        raise RunDirError(f"{f}: unreadable run record; pass --overwrite to start over") from None
    if not isinstance(rid, str) or not rid:
        raise RunDirError(f"{f}: no run id recorded; pass --overwrite to start over")
    return rid


def check_run_dir(run_dir, *, resume: bool, overwrite: bool) -> None:
    """Refuse (:class:`RunDirError`) a run directory this run may not use; changes nothing.

    Fresh runs need an empty or absent directory, or ``overwrite`` of one that is a run
    directory; ``resume`` needs a directory with a run record."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other: pass one")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {run_dir} exists and is not a directory")
    if resume:
        if not run_dir.is_dir():
            raise ResumeError(f"--resume: {run_dir} does not exist; start the run without --resume")
        if read_run_id(run_dir) is None and any((run_dir / "checkpoints").glob("step-*")):
            return  # a run directory from before run ids: its checkpoints carry none either
        if read_run_id(run_dir) is None:
            raise ResumeError(f"--resume: {run_dir} holds no run (no {RUN_FILE}); start the run without --resume")
        return
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    if not overwrite:
        raise RunDirError(f"{run_dir} is not empty (it holds an earlier run or other files): pass --resume to "
                          "continue that run or --overwrite to clear it and start a new one")
    if not _is_run_dir(run_dir) or any(not _ours(p.name) for p in run_dir.iterdir()):
        extra = sorted(p.name for p in run_dir.iterdir() if not _ours(p.name))
        raise RunDirError(f"--overwrite: {run_dir} is not a specfoundry run directory"
                          + (f" (it holds {', '.join(extra[:5])})" if extra else "") + "; refusing to clear it")


def claim_run_dir(run_dir, *, resume: bool, overwrite: bool) -> str:
    """Check ``run_dir`` (:func:`check_run_dir`), clear it for ``overwrite``, and return the run
    id: the recorded one for ``resume``, else a new one written to ``run.json``."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir, resume=resume, overwrite=overwrite)
    if resume:
        rid = read_run_id(run_dir)
        if rid is None:  # legacy directory: adopt its checkpoints under a recorded id
            rid = ""
        return rid
    if overwrite and run_dir.is_dir():
        for p in list(run_dir.iterdir()):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return _record_run_id(run_dir, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _nonfinite(tensors) -> str | None:
    for name, t in tensors:
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _optimizer_tensors(optimizer):
    """The optimizer's per-parameter state tensors (a plain torch optimizer's; a DeepSpeed ZeRO
    optimizer keeps its partitions elsewhere, and its loss scaler guards those)."""
    try:
        sd = optimizer.state_dict()
    except Exception:  # noqa: BLE001 - optimizers whose state_dict is collective or unsupported
        return
    state = sd.get("state") if isinstance(sd, dict) else None
    for i, st in enumerate(state.values() if isinstance(state, dict) else ()):
        for k, v in (st.items() if isinstance(st, dict) else ()):
            yield f"optimizer state {i}.{k}", v


def make_scheduler(optimizer, cfg: LoopConfig, horizon: dict | None = None):
    """Warm-up then decay to 0 at ``horizon["steps"]`` (read at every step, so a time-budgeted
    run can shorten it; default ``cfg.max_steps``)."""
    horizon = horizon if horizon is not None else {"steps": cfg.max_steps}

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon["steps"] - cfg.warmup_steps))
        if cfg.scheduler == "linear":
            return 1.0 - progress
        if cfg.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        raise ValueError(f"unknown scheduler {cfg.scheduler!r}")

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((Path(run_dir) / "checkpoints").glob("step-*"))
    return ckpts[-1] if ckpts else None


def _read_trainer_state(ckpt: Path) -> dict:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if not isinstance(state, dict):
        raise ValueError("trainer_state.json is not an object")
    for key in ("global_step", "epoch", "step_in_epoch", "tokens"):
        v = state.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"trainer_state.json: {key} = {v!r} is not a non-negative integer")
    if not isinstance(state.get("seconds"), (int, float)) or not math.isfinite(state["seconds"]):
        raise ValueError(f"trainer_state.json: seconds = {state.get('seconds')!r} is not a finite number")
    return state


def _restore_rng(ckpt: Path, process_index: int) -> None:
    """Restore this process's RNG states strictly (Accelerate skips a state it cannot load)."""
    import numpy as np
    from accelerate.utils.other import load

    states = load(ckpt / f"random_states_{process_index}.pkl")
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def _restore(accelerator, method, optimizer, ckpt: Path, run_id: str) -> dict:
    """Load ``ckpt`` completely or raise (ValueError, OSError, RuntimeError, ...) saying why."""
    state = _read_trainer_state(ckpt)
    if ckpt.name != f"step-{state['global_step']:07d}":
        raise ValueError(f"trainer_state.json says step {state['global_step']}, the directory {ckpt.name}")
    if run_id and state.get("run_id") != run_id:
        raise RunDirError(f"it belongs to another run (run id {state.get('run_id')!r}, this run {run_id!r})")
    accelerator.load_state(str(ckpt))
    _restore_rng(ckpt, accelerator.process_index)
    bad = _nonfinite(method.named_parameters()) or _nonfinite(_optimizer_tensors(optimizer))
    if bad is not None:
        raise NonFiniteError(f"non-finite values in {bad}")
    return state


def resume_from_checkpoint(accelerator, method, optimizer, run_dir: Path, run_id: str) -> tuple[Path, dict]:
    """Restore the newest checkpoint of run ``run_id`` that loads completely, warning for each
    newer one passed over; :class:`ResumeError` when none does."""
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"), reverse=True)
    if not ckpts:
        raise ResumeError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
    problems = []
    for ckpt in ckpts:
        try:
            state = _restore(accelerator, method, optimizer, ckpt, run_id)
            ok = True
        except Exception as exc:  # noqa: BLE001 - every failure makes the checkpoint unusable
            ok, why = False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if accelerator.num_processes > 1:  # every rank must resume from the same checkpoint
            flags = accelerator.gather(torch.tensor([int(ok)], device=accelerator.device))
            if not bool(flags.min()) and ok:
                ok, why = False, "another process could not restore it"
        if ok:
            if problems:
                accelerator.print(f"[train] resumed from {ckpt.name}, an older checkpoint, after skipping "
                                  f"{len(problems)} newer one(s)")
            return ckpt, state
        problems.append(f"{ckpt.name}: {why}")
        msg = f"checkpoint {ckpt} cannot be restored ({why}); trying the previous one"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        accelerator.print(f"[train] warning: {msg}")
    raise ResumeError(f"--resume: no checkpoint under {run_dir / 'checkpoints'} can be restored completely: "
                      + "; ".join(problems))


def _save_checkpoint(accelerator, run_dir: Path, state: dict, keep: int) -> Path:
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step-{state['global_step']:07d}"
    tmp = ckpt_root / f".tmp-step-{state['global_step']:07d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        # atomic: a checkpoint directory is complete or absent. Every process wrote into ``tmp``, a
        # name they all know, hence the swap alone rather than atomic_dir's own temporary directory
        replace_dir(tmp, final)
        # prune only this run's checkpoints (a run directory holds no other run's: see claim_run_dir)
        ours = [c for c in sorted(ckpt_root.glob("step-*")) if (_run_id_of(c) or "") == (state.get("run_id") or "")]
        for old in ours[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _record_run_id(run_dir: Path, **extra) -> str:
    """Record a new run id (and ``extra`` fields) in ``run_dir``'s ``run.json``; returns the id."""
    rid = uuid.uuid4().hex
    atomic_write_text(run_dir / RUN_FILE, json.dumps({"run_id": rid, **extra}))
    return rid


def _run_id_of(ckpt: Path):
    try:
        return json.loads((ckpt / "trainer_state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def train_loop(
    accelerator,
    method: torch.nn.Module,
    batches: Callable[[int, int], Iterator[dict]],
    cfg: LoopConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
    run_id: str | None = None,
) -> dict:
    """Train ``method``; ``batches(epoch, start_step)`` yields the batches of one epoch.

    ``stop_after`` ends the run early after that many steps *without* a final checkpoint (used
    by tests to simulate a killed run). ``evaluate(method)`` (every ``cfg.eval_every`` steps, on
    every process, in eval mode without gradients) returns metrics logged under ``eval/``.
    ``run_id``: the id :func:`claim_run_dir` returned (default: the one recorded in ``run_dir``,
    or a new one for a fresh directory). A fresh run refuses a directory that already holds
    checkpoints. Returns a summary dict.
    """
    run_dir = Path(run_dir)
    if run_id is None:
        if accelerator.is_main_process and not resume and read_run_id(run_dir) is None:
            run_dir.mkdir(parents=True, exist_ok=True)
            _record_run_id(run_dir)
        accelerator.wait_for_everyone()
        run_id = read_run_id(run_dir) or ""
    if not resume and any((run_dir / "checkpoints").glob("step-*")):
        raise RunDirError(f"{run_dir / 'checkpoints'} already holds checkpoints: pass --resume to continue that run "
                          "or --overwrite to clear it and start a new one")
    if cfg.max_nonfinite_skips < 0:
        raise ValueError(f"max_nonfinite_skips must be >= 0, got {cfg.max_nonfinite_skips}")
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds is not None:
        conf = ds.deepspeed_config
        for key, value in (("train_micro_batch_size_per_gpu", cfg.micro_batch_size),
                           ("gradient_accumulation_steps", accelerator.gradient_accumulation_steps),
                           ("gradient_clipping", cfg.grad_clip or 0.0)):
            if conf.get(key, "auto") == "auto":
                conf[key] = value
        conf.pop("train_batch_size", None) if conf.get("train_batch_size") == "auto" else None
    params = [p for p in method.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    horizon = {"steps": cfg.max_steps}
    scheduler = make_scheduler(optimizer, cfg, horizon)
    method, optimizer, scheduler = accelerator.prepare(method, optimizer, scheduler)

    state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "tokens": 0, "seconds": 0.0, "run_id": run_id,
             "nonfinite_skipped": 0}
    if resume:
        ckpt, state = resume_from_checkpoint(accelerator, method, optimizer, run_dir, run_id)
        state["run_id"] = run_id or state.get("run_id") or ""
        state.setdefault("nonfinite_skipped", 0)
        accelerator.print(f"[train] resumed from {ckpt} (step {state['global_step']})")
    horizon["steps"] = state.setdefault("max_steps", cfg.max_steps)

    # fp16 loss scaling expects overflowing gradients now and then (the scaler skips those steps and
    # lowers the scale): there only the loss is checked
    check_grads = getattr(accelerator, "scaler", None) is None and accelerator.mixed_precision != "fp16"
    method.train()
    t_start = time.perf_counter() - state["seconds"]
    t_run = time.perf_counter()
    history: list[dict] = []
    bar = tqdm(total=cfg.max_steps, initial=state["global_step"], desc="train", disable=not accelerator.is_main_process)
    stopped_by_time = False
    steps_this_run = 0
    # the schedule is fitted to the time budget after fit_at steps and refitted at 2x, 4x, ... that,
    # each time from the rate since the previous fit: one early fit made a run that was slowed for
    # its first minutes (another job on the CPU) train 649 of 3000 steps in 17 of its 52 minutes
    fit_at = max(cfg.warmup_steps, 10) + 10
    fit_from = (0, t_run)  # (steps_this_run, clock) at the previous fit
    while state["global_step"] < horizon["steps"]:
        got_batch = False
        for batch in batches(state["epoch"], state["step_in_epoch"]):
            got_batch = True
            with accelerator.accumulate(method):
                loss, metrics = method(batch)
                bad = None if bool(torch.isfinite(loss.detach()).all()) else f"loss {loss.item()}"
                if accelerator.num_processes > 1:  # all ranks skip (or stop) together: collectives match
                    flags = accelerator.gather(torch.tensor([int(bad is None)], device=accelerator.device))
                    if bad is None and not bool(flags.min()):
                        bad = "loss on another process"
                if bad is None:
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        if cfg.grad_clip:
                            norm = accelerator.clip_grad_norm_(params, cfg.grad_clip)
                        elif check_grads:
                            grads = [p.grad for p in params if p.grad is not None]
                            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float())
                                                                         for g in grads])) if grads else None
                        else:
                            norm = None
                        if check_grads and norm is not None and not bool(torch.isfinite(torch.as_tensor(norm)).all()):
                            bad = f"gradient norm {float(norm)}"
                if bad is not None:
                    state["nonfinite_skipped"] += 1
                    if state["nonfinite_skipped"] > cfg.max_nonfinite_skips:
                        bar.close()
                        raise NonFiniteError(
                            f"non-finite {bad} at step {state['global_step'] + 1}"
                            + (f" ({state['nonfinite_skipped'] - 1} such step(s) skipped before)"
                               if cfg.max_nonfinite_skips else "")
                            + ": training stopped (check the data, the learning rate and the checkpoint resumed from)")
                    optimizer.zero_grad()
                    state["step_in_epoch"] += 1  # the batch is consumed: a resume must not replay it
                    accelerator.print(f"[train] warning: skipped step {state['global_step'] + 1}: non-finite {bad} "
                                      f"({state['nonfinite_skipped']}/{cfg.max_nonfinite_skips})")
                    continue
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state["global_step"] += 1
            state["step_in_epoch"] += 1
            steps_this_run += 1
            state["tokens"] += int(batch["attention_mask"].sum())
            state["seconds"] = time.perf_counter() - t_start
            bar.update(1)
            if cfg.max_minutes and steps_this_run == fit_at:
                # a time budget that ends the run early would stop the decay mid-way at a high
                # learning rate: fit the schedule to the steps the budget holds at the recent rate
                # (never past the planned steps)
                now = time.perf_counter()
                per_step = (now - fit_from[1]) / (steps_this_run - fit_from[0])
                fits = state["global_step"] + int(0.97 * (cfg.max_minutes * 60 - state["seconds"]) / per_step)
                fitted = min(cfg.max_steps, max(fits, state["global_step"] + 1))
                if fitted != horizon["steps"]:
                    horizon["steps"] = state["max_steps"] = fitted
                    bar.total = horizon["steps"]
                    accelerator.print(f"[train] {cfg.max_minutes:g} min budget: schedule fitted to {fitted} steps "
                                      f"({per_step:.2f} s/step)")
                fit_from, fit_at = (steps_this_run, now), 2 * fit_at
            if state["global_step"] % cfg.log_every == 0 or state["global_step"] == 1:
                logs = {**metrics, "lr": scheduler.get_last_lr()[0], "epoch": state["epoch"],
                        "tokens": state["tokens"], "tokens_per_s": state["tokens"] / max(state["seconds"], 1e-9)}
                accelerator.log(logs, step=state["global_step"])
                history.append({"step": state["global_step"], **logs})
                bar.set_postfix(loss=f"{metrics.get('loss', loss.item()):.3f}", tau=f"{metrics.get('predicted_tau', 0):.2f}")
            if evaluate is not None and cfg.eval_every and state["global_step"] % cfg.eval_every == 0:
                method.eval()
                with torch.no_grad():
                    ev = {f"eval/{k}": v for k, v in evaluate(method).items()}
                method.train()
                accelerator.log(ev, step=state["global_step"])
                history.append({"step": state["global_step"], **ev})
            if stop_after is not None and steps_this_run >= stop_after:
                bar.close()
                return {"stopped_after": steps_this_run, **state, "history": history}
            if cfg.checkpoint_every and state["global_step"] % cfg.checkpoint_every == 0:
                _save_checkpoint(accelerator, run_dir, state, cfg.keep_checkpoints)
            if cfg.max_minutes and state["seconds"] > cfg.max_minutes * 60:
                stopped_by_time = True
                break
            if state["global_step"] >= horizon["steps"]:
                break
        if stopped_by_time or state["global_step"] >= horizon["steps"]:
            break
        if not got_batch and state["step_in_epoch"] == 0:
            raise ValueError("the training data produced no batch")
        state["epoch"] += 1
        state["step_in_epoch"] = 0
    bar.close()
    _save_checkpoint(accelerator, run_dir, state, cfg.keep_checkpoints)
    # the full weights (gathered from every rank under ZeRO-3), for saving the speculator
    full_state = accelerator.get_state_dict(method)
    return {**state, "stopped_by_time": stopped_by_time, "history": history, "state_dict": full_state}
