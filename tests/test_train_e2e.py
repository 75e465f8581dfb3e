"""A whole training run on a tiny local target (with SmolLM2's tokenizer and chat template):
data, hidden states, training, the run directory, the speculator loading losslessly; and the
same run under DeepSpeed ZeRO-2 and ZeRO-3 with 2 processes on CPU (gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
from specfoundry.runtime.speculators import read_config
from tiny_models import TINY_PROMPTS, tiny_target_with_smollm2_tokenizer

PROMPTS = TINY_PROMPTS


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory, smollm2):
    return tiny_target_with_smollm2_tokenizer(tmp_path_factory.mktemp("tiny-target"), smollm2.vocab_size)


def _recipe(tmp_path, target_dir, hidden_states="offline", **launcher) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    recipe = {
        "name": "tiny-eagle3", "method": "eagle3", "output_dir": str(tmp_path / "run"),
        "target": {"name": str(target_dir), "dtype": "fp32", "device": "cpu"},
        "speculator": {"draft_vocab_size": 512},
        "data": {"prompts": [{"source": "file", "path": str(prompts), "limit": 12}],
                 "responses": {"max_new_tokens": 12, "batch_size": 8, "dtype": "fp32"},
                 "max_seq_len": 64, "eval_prompts": 2, "hidden_states": hidden_states,
                 "cache_dir": str(tmp_path / "cache")},
        "training": {"max_steps": 4, "batch_size": 2, "learning_rate": 1e-3, "log_every": 1, "precision": "fp32"},
        "tracking": {"wandb_mode": "offline"},
        "evaluation": {"limit": 1, "max_new_tokens": 8, "temperatures": [0.0], "depth": 3},
        "launcher": launcher or {"config": "single-cpu"},
    }
    path = tmp_path / "tiny-eagle3.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _check_run(run: Path, target_dir):
    assert (run / "recipe.resolved.yaml").exists()
    assert list((run / "checkpoints").glob("step-*"))
    cfg = read_config(run / "speculator")
    assert cfg["speculator_type"] == "eagle3" and cfg["architecture"]["draft_vocab_size"] == 512
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens_trained"] > 0
    assert "builtin-heldout" in summary["measured"] and summary["measured"]["builtin-heldout"]["T=0"]["identical_rate"] == 1.0
    assert summary["evaluation"]["sampled_trees"] is True  # tau at T > 0 measured on the recipe's tree
    # the evaluation timed the runtime shapes on the held-out prompts and stored its choice
    shape = cfg["training"]["runtime_shape"]
    assert summary["runtime_shape"] == shape and shape["prompts"] == 2
    from specfoundry.runtime.adaptive import RUNTIME_SHAPE_CANDIDATES
    from specfoundry.runtime.tune import chosen_candidate, shape_label

    assert set(shape["speedups"]) == set(RUNTIME_SHAPE_CANDIDATES)
    chosen = chosen_candidate(shape)
    # the choice is stored; under the controller when it did not beat plain decoding
    assert shape_label(shape) == (chosen if shape["speedups"][chosen] >= 1.0 or chosen == "adaptive"
                                  else f"adaptive (up to {chosen})")
    # and on the same prompts the scale of a sampling request's temperature its drafts are drawn at
    calibrated = cfg["training"]["draft_temperature"]
    assert summary["draft_temperature"] == calibrated and calibrated["prompts"] == 2 and calibrated["positions"] > 0
    assert calibrated["temperatures"] == [0.7, 1.0]
    target = load_target(str(target_dir))
    assert load_drafter(str(run / "speculator"), target=target).draft_temperature == calibrated["scale"]
    gen = SpeculativeGenerator(target, load_drafter(str(run / "speculator"), target=target), adaptive=False)
    spec = gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False)
    plain = gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False, speculate=False)
    assert spec.token_ids == plain.token_ids
    return summary


def test_single_process_run_writes_a_complete_run_directory(tmp_path, tiny_target_dir, monkeypatch, capsys):
    from specfoundry.train.run import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main([str(_recipe(tmp_path, tiny_target_dir)), "--set", "training.eval_every=2",
                 "--set", "data.capture_batch_size=4"]) == 0
    _check_run(tmp_path / "run", tiny_target_dir)
    # the engine's offline store read every sequence's states from the self-distillation's forwards
    stores = list((tmp_path / "cache" / "features").glob("*-engine-gen"))
    assert len(stores) == 2  # training and held-out sequences
    for store in stores:
        assert json.loads((store / "manifest.json").read_text())["header"]["states"] == "generation"
    assert "hidden states came from the self-distillation's forwards" in capsys.readouterr().out
    capture = json.loads((tmp_path / "run" / "train_summary.json").read_text())["stages"]["capture"]
    assert capture["from_generation"] == capture["planned"] > 0
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert runs
    # eval_every: held-out metrics at steps 2 and 4, logged to W&B beside the training metrics
    from specfoundry.train.tracking import read_offline_history

    history = read_offline_history(runs[0])
    evals = [r for r in history if "eval/loss" in r]
    assert [r["_step"] for r in evals] == [2, 4] and all(r["eval/loss"] > 0 for r in evals)
    assert any("loss" in r and "eval/loss" not in r for r in history)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_two_processes_on_cpu(tmp_path, tiny_target_dir, stage):
    recipe = _recipe(tmp_path, tiny_target_dir, config="zero-cpu-2proc", deepspeed=stage)
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    # zero2: the batched engine capture, whose store the main process fills from the states its
    # self-distillation kept while the other rank waits, then reads
    extra = ["--set", "data.capture_batch_size=4"] if stage == "zero2" else []
    proc = subprocess.run([sys.executable, "-m", "specfoundry.runtime.cli", "train", str(recipe), *extra], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _check_run(tmp_path / "run", tiny_target_dir)
    stores = list((tmp_path / "cache" / "features").glob("*-engine-gen"))
    assert len(stores) == (1 if stage == "zero2" else 0), stores
    # every rank's ZeRO shard went into the checkpoint
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    assert len(list(ckpt.rglob("*rank_1*"))) >= 1, sorted(p.name for p in ckpt.rglob("*"))
    assert summary["steps"] == 4


@pytest.mark.parametrize("merge", [True, False])
def test_medusa2_run_saves_its_backbone_and_heads_for_it(tmp_path, tiny_target_dir, monkeypatch, merge):
    """Medusa-2 fine-tunes the backbone: the run writes it (merged dir or peft adapter), the heads
    record *its* identity, load losslessly with it and are refused with the original target."""
    from specfoundry.runtime.speculators import TargetMismatchError
    from specfoundry.train.run import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    path = _recipe(tmp_path, tiny_target_dir, hidden_states="online")
    recipe = yaml.safe_load(path.read_text())
    recipe.update(name="tiny-medusa2", method="medusa2")
    recipe["speculator"] = {"num_heads": 2, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}, "merge": merge,
                            "heads_warmup_steps": 1}
    recipe["training"]["learning_rate"] = 5e-2  # large enough that the merged weights visibly move
    path.write_text(yaml.safe_dump(recipe))
    assert main([str(path)]) == 0
    run = tmp_path / "run"
    backbone_dir = run / ("target" if merge else "adapter")
    assert backbone_dir.is_dir() and not (run / ("adapter" if merge else "target")).exists()
    base = load_target(str(tiny_target_dir))
    tuned = load_target(str(backbone_dir))
    assert tuned.fingerprint() != base.fingerprint()
    cfg = read_config(run / "speculator")
    assert cfg["speculator_type"] == "medusa" and cfg["target"]["fingerprint"] == tuned.fingerprint()
    gen = SpeculativeGenerator(tuned, load_drafter(str(run / "speculator"), target=tuned), adaptive=False)
    spec = gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False)
    assert spec.token_ids == gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False,
                                          speculate=False).token_ids
    with pytest.raises(TargetMismatchError):
        load_drafter(str(run / "speculator"), target=base)
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["measured"]["builtin-heldout"]["T=0"]["identical_rate"] == 1.0


@pytest.mark.parametrize("launch", ["single", "zero3"])
def test_draft_distillation_run_saves_a_loadable_hf_draft(tmp_path, tiny_target_dir, launch):
    """A draft recipe (a fresh 1-layer `config` draft) ends in an HF model directory the draft
    drafter loads losslessly; under ZeRO-3 with 2 processes the saved weights are the full ones."""
    launcher = {"config": "zero-cpu-2proc", "deepspeed": "zero3"} if launch == "zero3" else {}
    path = _recipe(tmp_path, tiny_target_dir, hidden_states="online", **launcher)
    recipe = yaml.safe_load(path.read_text())
    recipe.update(name="tiny-draft", method="draft")
    recipe["speculator"] = {"config": {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 4}}
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "specfoundry.runtime.cli", "train", str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = tmp_path / "run" / "speculator"
    assert (spec / "config.json").exists() and (spec / "specfoundry_target.json").exists()
    draft = load_target(str(spec))
    assert draft.num_layers == 1 and all(p.abs().sum() > 0 for p in draft.model.parameters())  # not empty shards
    target = load_target(str(tiny_target_dir))
    gen = SpeculativeGenerator(target, load_drafter(str(spec), target=target), adaptive=False, max_depth=3)
    spec_out = gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False)
    assert spec_out.token_ids == gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False,
                                              speculate=False).token_ids


def _poison(safetensors_file: Path) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(str(safetensors_file))
    name = next(k for k, v in t.items() if v.is_floating_point() and v.numel() > 1)
    t[name] = t[name].clone()
    t[name].view(-1)[0] = float("nan")
    save_file(t, str(safetensors_file), metadata={"format": "pt"})


@pytest.mark.slow
def test_run_directory_ownership_and_nan_checkpoints_through_the_cli(tmp_path, tiny_target_dir, monkeypatch, capsys):
    """Issue 16 end to end: a second fresh run into a run directory is refused, NaN in every
    checkpoint makes --resume fail (not 0 steps at loss=nan with rc 0), NaN in the speculator
    makes export fail before writing anything."""
    from specfoundry.runtime.cli import main as cli

    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = str(_recipe(tmp_path, tiny_target_dir))
    sets = ["--set", "training.checkpoint_every=2"]
    assert cli(["train", recipe, *sets]) == 0
    run = tmp_path / "run"
    assert (run / "run.json").is_file()
    capsys.readouterr()
    assert cli(["train", recipe, *sets]) == 2
    assert "--resume" in capsys.readouterr().err
    for ckpt in (run / "checkpoints").glob("step-*"):
        _poison(ckpt / "model.safetensors")
    with pytest.warns(RuntimeWarning):
        assert cli(["train", recipe, "--resume", *sets]) == 2
    assert "can be restored completely" in capsys.readouterr().err
    _poison(run / "speculator" / "model.safetensors")
    assert cli(["export", str(run), "--target", str(tiny_target_dir), "--formats", "vllm,sglang"]) == 2
    assert "non-finite" in capsys.readouterr().err
    assert not (run / "export" / "vllm").exists()


def test_medusa1_run_fits_its_tree_to_the_heads_and_keeps_it(tmp_path, tiny_target_dir, monkeypatch):
    """``speculator.choices: fit``: after training the heads are measured on the held-out
    sequences, the best-counted paths become the checkpoint's tree (its drafter's and exporter's
    default), never worse than the default tree on those counts, and decoding stays lossless."""
    from specfoundry.train.run import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    path = _recipe(tmp_path, tiny_target_dir)
    recipe = yaml.safe_load(path.read_text())
    recipe.update(name="tiny-medusa1", method="medusa1")
    recipe["speculator"] = {"num_heads": 2, "draft_vocab_size": 512, "choices": "fit"}
    recipe["training"]["eval_every"] = 2
    recipe["data"]["prompts"][0]["limit"] = 24  # enough sequences that one is split off for the fit
    path.write_text(yaml.safe_dump(recipe))
    assert main([str(path)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "train_summary.json").read_text())
    tree = summary["tree"]
    assert tree["positions"] > 0 and tree["nodes"] == 24 == len(tree["choices"])
    assert tree["expected_tau"]["fitted"] >= tree["expected_tau"]["default"] >= 1.0
    stored = read_config(run / "speculator")["training"]["drafter_options"]["choices"]
    assert stored == tree["choices"]
    paths = {tuple(c) for c in stored}
    assert all(len(c) == 1 or tuple(c[:-1]) in paths for c in stored) and all(len(c) <= 2 for c in stored)
    target = load_target(str(tiny_target_dir))
    drafter = load_drafter(str(run / "speculator"), target=target)
    assert sorted(drafter.paths) == sorted(stored)
    gen = SpeculativeGenerator(target, drafter, adaptive=False)
    spec = gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False)
    assert spec.token_ids == gen.generate(prompt="Hello there", max_new_tokens=12, stop_at_eos=False,
                                          speculate=False).token_ids
