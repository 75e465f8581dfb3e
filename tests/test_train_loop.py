"""The training loop: loss goes down, atomic checkpoints, and resume continues the exact data
order to the same weights as an uninterrupted run."""

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from tiny_models import tiny_llama
from specfoundry.runtime.speculators import Eagle3Head
from specfoundry.train.loop import LoopConfig, latest_checkpoint, train_loop
from specfoundry.train.methods.eagle3 import Eagle3Method

pytestmark = pytest.mark.usefixtures("single_thread")


def _data(target, head, n_batches=5, B=2, L=10):
    out = []
    for i in range(n_batches):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, target.vocab_size, (B, L), generator=g)
        with torch.no_grad():
            hs = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
        out.append({"input_ids": ids, "attention_mask": torch.ones(B, L, dtype=torch.long),
                    "loss_mask": torch.ones(B, L, dtype=torch.bool), "batch_id": torch.tensor(i),
                    "features": torch.stack([hs[j] for j in head.feature_layers], 2), "last_hidden": hs[-1]})
    return out


def _run(tmp, resume=False, stop_after=None, seen=None):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    target = tiny_llama(0, dtype=torch.float32)
    head = Eagle3Head.from_target(target, draft_vocab_size=48)
    method = Eagle3Method(head, target.lm_head, ttt_steps=2)
    data = _data(target, head)

    def batches(epoch, start):
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(100 + epoch)).tolist()
        for i in order[start:]:
            if seen is not None:
                seen.append((epoch, int(data[i]["batch_id"])))
            yield data[i]

    cfg = LoopConfig(max_steps=12, learning_rate=3e-3, warmup_steps=2, checkpoint_every=4, log_every=1)
    summary = train_loop(acc, method, batches, cfg, tmp, resume=resume, stop_after=stop_after)
    return summary, acc.unwrap_model(method).head.state_dict()


def test_loss_goes_down_and_checkpoints_are_complete(tmp_path):
    summary, _ = _run(tmp_path)
    losses = [h["loss"] for h in summary["history"]]
    assert summary["global_step"] == 12 and summary["epoch"] == 2
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-0000012"
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == 12
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert len(list((tmp_path / "checkpoints").glob("step-*"))) == 2  # keep_checkpoints


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    seen_full, seen_killed = [], []
    _, w_full = _run(tmp_path / "full", seen=seen_full)
    killed, _ = _run(tmp_path / "killed", stop_after=7, seen=seen_killed)  # dies after the step-4 checkpoint
    assert killed["stopped_after"] == 7 and latest_checkpoint(tmp_path / "killed").name == "step-0000004"
    resumed_seen = []
    summary, w_resumed = _run(tmp_path / "killed", resume=True, seen=resumed_seen)
    assert summary["global_step"] == 12
    ckpt_step = 4
    assert seen_killed[:ckpt_step] + resumed_seen == seen_full
    for k in w_full:
        torch.testing.assert_close(w_resumed[k], w_full[k], rtol=1e-5, atol=1e-6)


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path, monkeypatch):
    from specfoundry.train.tracking import init_tracking, read_offline_history, wandb_run_dir

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True, log_with="wandb")
    mode = init_tracking(acc, "specfoundry-test", "tiny", {"lr": 3e-3}, tmp_path)
    assert mode == "offline"
    target = tiny_llama(0, dtype=torch.float32)
    head = Eagle3Head.from_target(target, draft_vocab_size=48)
    data = _data(target, head, n_batches=3)
    train_loop(acc, Eagle3Method(head, target.lm_head, ttt_steps=2), lambda e, s: iter(data[s:]),
               LoopConfig(max_steps=4, log_every=1), tmp_path)
    acc.end_training()
    run = wandb_run_dir(tmp_path)
    assert run is not None and run.name.startswith("offline-run-")
    rows = read_offline_history(run)
    assert [r["_step"] for r in rows] == [1, 2, 3, 4]
    assert {"loss", "loss/step0", "top1/step0", "predicted_tau", "lr", "tokens_per_s"} <= set(rows[-1])


@pytest.mark.parametrize("slow_steps, want", [(20, 200), (10_000, (55, 62))])
def test_time_budget_schedule_is_refitted_from_the_recent_rate(tmp_path, monkeypatch, slow_steps, want):
    """A fake clock: 1 s per step for the first ``slow_steps`` steps (another job on the CPU), then
    0.1 s, under a 60-s budget. The schedule fitted at step 20 (58 steps) grows back to the plan
    (200) once the steps are fast again; when they stay slow it stays at what 60 s hold."""
    import types

    import specfoundry.train.loop as loop_module

    clock = {"t": 0.0, "steps": 0}
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: clock["t"], time=lambda: 0.0))
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    target = tiny_llama(0, dtype=torch.float32, hidden=16, layers=2)
    head = Eagle3Head.from_target(target, draft_vocab_size=16)
    method = Eagle3Method(head, target.lm_head, ttt_steps=1)
    data = _data(target, head, n_batches=4, B=1, L=6)

    def batches(epoch, start):
        for b in data[start:]:
            clock["t"] += 1.0 if clock["steps"] < slow_steps else 0.1
            clock["steps"] += 1
            yield b

    cfg = LoopConfig(max_steps=200, learning_rate=1e-3, warmup_steps=2, checkpoint_every=0, log_every=1000,
                     max_minutes=1.0)
    summary = train_loop(acc, method, batches, cfg, tmp_path)
    if isinstance(want, tuple):
        assert want[0] <= summary["global_step"] <= want[1], summary["global_step"]
    else:
        assert summary["global_step"] == want and summary["max_steps"] == want
