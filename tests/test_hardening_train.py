"""Hardening of training runs (issue 16): non-finite losses/gradients stop the run, a run
directory belongs to one run, resume takes the newest checkpoint that restores completely."""

import json
import pickle

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from tiny_models import tiny_llama
from specfoundry.runtime.speculators import Eagle3Head
from specfoundry.train.loop import (
    LoopConfig,
    NonFiniteError,
    ResumeError,
    RunDirError,
    check_run_dir,
    claim_run_dir,
    latest_checkpoint,
    read_run_id,
    train_loop,
)
from specfoundry.train.methods.eagle3 import Eagle3Method

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, dtype=torch.float32, layers=2)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=48, feature_layers=[0, 1, 2])
    data = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, target.vocab_size, (2, 8), generator=g)
        with torch.no_grad():
            hs = target.model.model(input_ids=ids, output_hidden_states=True).hidden_states
        data.append({"input_ids": ids, "attention_mask": torch.ones(2, 8, dtype=torch.long),
                     "loss_mask": torch.ones(2, 8, dtype=torch.bool),
                     "features": torch.stack([hs[j] for j in head.feature_layers], 2), "last_hidden": hs[-1]})
    return target, data


class _Poisoned(torch.nn.Module):
    """Wraps a method: from its ``at``-th call on, the loss is NaN."""

    def __init__(self, inner, at: int):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, batch):
        self.calls += 1
        loss, metrics = self.inner(batch)
        return (loss * float("nan") if self.calls >= self.at else loss), metrics


class _GradPoisoned(torch.nn.Module):
    def __init__(self, inner, at: int):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0
        self.p = next(p for p in inner.parameters() if p.requires_grad)

    def forward(self, batch):
        self.calls += 1
        loss, metrics = self.inner(batch)
        if self.calls >= self.at:  # a finite loss whose gradient is not
            loss = loss + (self.p.flatten()[0] - self.p.flatten()[0].detach()) * 0.0
            self.p.register_hook(lambda g: torch.full_like(g, float("nan")))
        return loss, metrics


def _run(run_dir, setup, *, resume=False, wrap=None, max_steps=6, skips=0, run_id=None, stop_after=None):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    target, data = setup
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, draft_vocab_size=48, feature_layers=[0, 1, 2])
    method = Eagle3Method(head, target.lm_head, ttt_steps=1)
    if wrap is not None:
        method = wrap(method)
    cfg = LoopConfig(max_steps=max_steps, learning_rate=1e-3, checkpoint_every=2, log_every=1,
                     max_nonfinite_skips=skips, keep_checkpoints=3)
    return train_loop(acc, method, lambda e, s: iter(data[s:]), cfg, run_dir, resume=resume, run_id=run_id,
                      stop_after=stop_after)


def test_nan_loss_stops_training_with_a_clear_error(tmp_path, setup):
    with pytest.raises(NonFiniteError, match=r"non-finite loss nan at step 3"):
        _run(tmp_path / "r", setup, wrap=lambda m: _Poisoned(m, 3))
    # the step-2 checkpoint is the last one written: nothing after the NaN was saved
    assert latest_checkpoint(tmp_path / "r").name == "step-0000002"


def test_nan_gradient_with_finite_loss_stops_training(tmp_path, setup):
    with pytest.raises(NonFiniteError, match=r"non-finite gradient norm nan at step 2"):
        _run(tmp_path / "r", setup, wrap=lambda m: _GradPoisoned(m, 2))


def test_nonfinite_steps_can_be_skipped_and_counted_when_asked(tmp_path, setup):
    calls = {"n": 0}

    class Every3rd(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            calls["n"] += 1
            loss, m = self.inner(batch)
            return (loss * float("nan") if calls["n"] % 3 == 0 else loss), m

    summary = _run(tmp_path / "r", setup, wrap=Every3rd, skips=5)
    assert summary["global_step"] == 6 and summary["nonfinite_skipped"] == 2
    with pytest.raises(NonFiniteError, match="1 such step"):
        calls["n"] = 0
        _run(tmp_path / "r2", setup, wrap=Every3rd, skips=1)
    for p in summary["state_dict"].values():
        assert torch.isfinite(p).all()


def _poison_weights(ckpt):
    from safetensors.torch import load_file, save_file

    f = ckpt / "model.safetensors"
    t = load_file(str(f))
    name = next(k for k, v in t.items() if v.is_floating_point())
    t[name] = t[name].clone()
    t[name].view(-1)[0] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})


def test_nan_in_newest_checkpoint_falls_back_and_all_nan_is_an_error(tmp_path, setup):
    run = tmp_path / "r"
    _run(run, setup, stop_after=5)  # checkpoints at steps 2 and 4
    _poison_weights(run / "checkpoints" / "step-0000004")
    with pytest.warns(RuntimeWarning, match=r"step-0000004 cannot be restored \(NonFiniteError"):
        summary = _run(run, setup, resume=True)
    assert summary["global_step"] == 6
    assert all(torch.isfinite(v).all() for v in summary["state_dict"].values())
    for ckpt in (run / "checkpoints").glob("step-*"):
        _poison_weights(ckpt)
    with pytest.warns(RuntimeWarning), pytest.raises(ResumeError, match="can be restored completely"):
        _run(run, setup, resume=True)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, setup):
    run = tmp_path / "r"
    _run(run, setup, stop_after=5)
    newest = run / "checkpoints" / "step-0000004"
    data = (newest / "model.safetensors").read_bytes()
    (newest / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.warns(RuntimeWarning, match="step-0000004 cannot be restored"):
        summary = _run(run, setup, resume=True)
    assert summary["global_step"] == 6
    # resumed from step 2: the same weights as an uninterrupted run
    full = _run(tmp_path / "full", setup)
    for k, v in full["state_dict"].items():
        torch.testing.assert_close(summary["state_dict"][k], v, rtol=1e-5, atol=1e-6)


def test_tampered_rng_state_is_not_silently_ignored(tmp_path, setup):
    run = tmp_path / "r"
    _run(run, setup, stop_after=3)  # one checkpoint (step 2)
    (run / "checkpoints" / "step-0000002" / "random_states_0.pkl").write_bytes(pickle.dumps({"random_state": 1}))
    with pytest.warns(RuntimeWarning, match="step-0000002 cannot be restored"), \
            pytest.raises(ResumeError, match="random_states|Unpickl|weights_only|random_state"):
        _run(run, setup, resume=True)


def test_a_second_run_into_the_same_directory_needs_resume_or_overwrite(tmp_path, setup):
    run = tmp_path / "r"
    rid = claim_run_dir(run, resume=False, overwrite=False)
    assert read_run_id(run) == rid
    _run(run, setup, run_id=rid, max_steps=4)
    # a fresh run into it: refused by the directory check and by the loop itself
    with pytest.raises(RunDirError, match="--resume .* or --overwrite"):
        claim_run_dir(run, resume=False, overwrite=False)
    with pytest.raises(RunDirError, match="already holds checkpoints"):
        _run(run, setup, run_id="other", max_steps=4)
    # --overwrite clears it and records a new id; no checkpoint of the old run is left
    rid2 = claim_run_dir(run, resume=False, overwrite=True)
    assert rid2 != rid and not (run / "checkpoints").exists()
    _run(run, setup, run_id=rid2, max_steps=2)
    # a checkpoint of another run dropped into the directory is never resumed from
    other = run / "checkpoints" / "step-0000009"
    import shutil

    shutil.copytree(run / "checkpoints" / "step-0000002", other)
    st = json.loads((other / "trainer_state.json").read_text())
    (other / "trainer_state.json").write_text(json.dumps({**st, "global_step": 9, "run_id": rid}))
    with pytest.warns(RuntimeWarning, match="belongs to another run"):
        summary = _run(run, setup, resume=True, run_id=claim_run_dir(run, resume=True, overwrite=False), max_steps=4)
    assert summary["global_step"] == 2  # this run's step 2 (its schedule ends there), not the other's step 9


def test_run_directory_checks(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        check_run_dir(f, resume=False, overwrite=False)
    mine = tmp_path / "home"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(RunDirError, match="not a specfoundry run directory"):
        claim_run_dir(mine, resume=False, overwrite=True)
    assert (mine / "notes.txt").read_text() == "precious"
    with pytest.raises(RunDirError, match="contradict"):
        check_run_dir(tmp_path / "new", resume=True, overwrite=True)
    with pytest.raises(ResumeError, match="does not exist"):
        check_run_dir(tmp_path / "new", resume=True, overwrite=False)
    check_run_dir(tmp_path / "new", resume=False, overwrite=False)  # a new directory is fine


def test_train_run_refuses_another_runs_directory_before_loading_anything(tmp_path):
    from specfoundry.train.run import main

    out = tmp_path / "r"
    claim_run_dir(out, resume=False, overwrite=False)
    (out / "checkpoints" / "step-0000004").mkdir(parents=True)
    with pytest.raises(RunDirError, match="pass --resume to continue that run or --overwrite"):
        main(["eagle3-smollm2-135m", "--set", f"output_dir={out}"])
    with pytest.raises(RunDirError, match="contradict"):
        main(["eagle3-smollm2-135m", "--resume", "--overwrite", "--set", f"output_dir={out}"])


def test_train_without_a_recipe_prints_usage_instead_of_training(capsys):
    from specfoundry.runtime.cli import main

    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "name a recipe" in err and "eagle3-smollm2-135m" in err


@pytest.mark.parametrize("field, value, message", [
    ("evaluation.depth", 1000000, "depth"),
    ("evaluation.total_tokens", 1000000, "total_tokens"),
])
def test_train_run_refuses_an_unbounded_evaluation_shape_before_training(tmp_path, field, value, message):
    from specfoundry.train.recipe import RecipeError
    from specfoundry.train.run import main

    with pytest.raises((ValueError, RecipeError), match=message):
        main(["eagle3-smollm2-135m", "--set", f"output_dir={tmp_path / 'r'}", "--set", f"{field}={value}"])
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("field, value", [("log_every", 0), ("max_steps", 0), ("learning_rate", float("nan")),
                                          ("grad_clip", -1.0), ("checkpoint_every", 2.5), ("scheduler", "cosin"),
                                          ("max_nonfinite_skips", -1), ("max_minutes", float("inf"))])
def test_loop_config_values_are_checked(field, value):
    with pytest.raises(ValueError, match=field if field != "scheduler" else "scheduler must be"):
        LoopConfig(**{"max_steps": 4, field: value})


def test_overwrite_clears_a_run_directory_with_leftovers_of_atomic_writes(tmp_path):
    run = tmp_path / "r"
    claim_run_dir(run, resume=False, overwrite=False)
    (run / "checkpoints" / ".tmp-step-0000004").mkdir(parents=True)
    (run / ".speculator.abc.tmp").mkdir()
    claim_run_dir(run, resume=False, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]


def test_nan_in_the_optimizer_state_makes_a_checkpoint_unusable(tmp_path, setup):
    run = tmp_path / "r"
    _run(run, setup, stop_after=3)  # one checkpoint (step 2)
    f = run / "checkpoints" / "step-0000002" / "optimizer.bin"
    sd = torch.load(f, weights_only=True)
    first = next(iter(sd["state"].values()))
    first["exp_avg"].view(-1)[0] = float("nan")
    torch.save(sd, f)
    with pytest.warns(RuntimeWarning, match=r"non-finite values in optimizer state"), \
            pytest.raises(ResumeError, match="step-0000002"):
        _run(run, setup, resume=True)


def test_resume_with_a_changed_recipe_is_refused(tmp_path):
    from specfoundry.train.recipe import dump_resolved, load_recipe, resolve
    from specfoundry.train.run import check_resume_recipe, main

    out = tmp_path / "r"
    claim_run_dir(out, resume=False, overwrite=False)
    recipe = resolve(load_recipe("eagle3-smollm2-135m", overrides=[f"output_dir={out}"]))
    dump_resolved(recipe, out)
    check_resume_recipe(recipe, out)  # the same recipe: fine
    # reporting and checkpoint cadence may change on resume
    check_resume_recipe(resolve(load_recipe("eagle3-smollm2-135m", overrides=[
        f"output_dir={out}", "training.log_every=3", "evaluation.limit=2"])), out)
    with pytest.raises(ValueError, match=r"recipe differs .*training.learning_rate"):
        main(["eagle3-smollm2-135m", "--resume", "--set", f"output_dir={out}", "--set", "training.learning_rate=0.1"])


def test_no_gradient_clip_still_checks_gradients(tmp_path, setup):
    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    target, data = setup
    head = Eagle3Head.from_target(target, draft_vocab_size=48, feature_layers=[0, 1, 2])
    method = _GradPoisoned(Eagle3Method(head, target.lm_head, ttt_steps=1), 2)
    with pytest.raises(NonFiniteError, match="gradient norm"):
        train_loop(acc, method, lambda e, s: iter(data[s:]), LoopConfig(max_steps=4, grad_clip=None), tmp_path / "r")


def test_a_checkpoint_whose_state_disagrees_with_its_step_is_passed_over(tmp_path, setup):
    run = tmp_path / "r"
    _run(run, setup, stop_after=5)
    f = run / "checkpoints" / "step-0000004" / "trainer_state.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "global_step": 1}))
    with pytest.warns(RuntimeWarning, match="says step 1"):
        summary = _run(run, setup, resume=True)
    assert summary["global_step"] == 6
