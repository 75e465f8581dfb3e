"""The one training loop (plain PyTorch + Accelerate): steps, logging, checkpoints, resume.

The method is an ``nn.Module`` whose ``forward(batch)`` returns ``(loss, metrics)``; the loop
knows nothing about EAGLE or Medusa. It runs unchanged under ``accelerate launch`` with a
single process, DDP or DeepSpeed ZeRO-2/3 (the launcher config decides).

Checkpoints (every ``checkpoint_every`` steps and at the end) are written atomically: the
Accelerate state (model, optimizer, scheduler, RNG of every process) plus ``trainer_state.json``
(global step, epoch, step within the epoch) go to a temp directory that is renamed into
``checkpoints/step-XXXXXXX``. ``resume=True`` restores the newest one and skips the batches
already consumed, so the data order continues exactly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm


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
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    return ckpts[-1] if ckpts else None


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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic: a checkpoint directory is complete or absent
        for old in sorted(ckpt_root.glob("step-*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


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
) -> dict:
    """Train ``method``; ``batches(epoch, start_step)`` yields the batches of one epoch.

    ``stop_after`` ends the run early after that many steps *without* a final checkpoint (used
    by tests to simulate a killed run). ``evaluate(method)`` (every ``cfg.eval_every`` steps, on
    every process, in eval mode without gradients) returns metrics logged under ``eval/``.
    Returns a summary dict.
    """
    run_dir = Path(run_dir)
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

    state = {"global_step": 0, "epoch": 0, "step_in_epoch": 0, "tokens": 0, "seconds": 0.0}
    if resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
        accelerator.load_state(str(ckpt))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        accelerator.print(f"[train] resumed from {ckpt} (step {state['global_step']})")
    horizon["steps"] = state.setdefault("max_steps", cfg.max_steps)

    method.train()
    t_start = time.perf_counter() - state["seconds"]
    t_run = time.perf_counter()
    history: list[dict] = []
    bar = tqdm(total=cfg.max_steps, initial=state["global_step"], desc="train", disable=not accelerator.is_main_process)
    stopped_by_time = False
    steps_this_run = 0
    fit_at = max(cfg.warmup_steps, 10) + 10  # steps measured before fitting the schedule to the budget
    while state["global_step"] < horizon["steps"]:
        got_batch = False
        for batch in batches(state["epoch"], state["step_in_epoch"]):
            got_batch = True
            with accelerator.accumulate(method):
                loss, metrics = method(batch)
                accelerator.backward(loss)
                if cfg.grad_clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            state["global_step"] += 1
            state["step_in_epoch"] += 1
            steps_this_run += 1
            state["tokens"] += int(batch["attention_mask"].sum())
            state["seconds"] = time.perf_counter() - t_start
            bar.update(1)
            if cfg.max_minutes and steps_this_run == fit_at and not state.get("fitted"):
                # a time budget that ends the run early would stop the decay mid-way at a high
                # learning rate: shrink the schedule (once) to the steps the budget holds
                per_step = (time.perf_counter() - t_run) / steps_this_run
                fits = state["global_step"] + int(0.97 * (cfg.max_minutes * 60 - state["seconds"]) / per_step)
                if fits < horizon["steps"]:
                    horizon["steps"] = state["max_steps"] = max(fits, state["global_step"] + 1)
                    bar.total = horizon["steps"]
                    accelerator.print(f"[train] {cfg.max_minutes:g} min budget: schedule fitted to {fits} steps")
                state["fitted"] = True
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
