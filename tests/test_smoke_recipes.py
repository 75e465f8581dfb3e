"""The GPU recipes' code path on CPU: ``specfoundry train <recipe> --smoke`` swaps only what this
machine cannot hold (a tiny random target of the same family, CPU/gloo/fp32, a few steps, local
prompts) and keeps everything else. Every GPU recipe runs end to end in the default tier (2
processes under its DeepSpeed ZeRO stage, 30-50 s each on the 2-core dev machine): eagle-llama3-70b
checked in most detail (ZeRO-3, online hidden states, 7 TTT steps, 32000-token draft vocabulary,
checkpoints of both ranks, W&B offline, export), and its run is the reference of the 2-machine
launch (two launches on 127.0.0.1, one process each, gloo), which must train the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specfoundry.train.launcher import zero_stage
from specfoundry.train.plan import make_plan
from specfoundry.train.preflight import failures, preflight
from specfoundry.train.presets import find_architecture
from specfoundry.train.recipe import load_recipe, resolve
from specfoundry.train.smoke import smoke_overrides

GPU_RECIPES = ["eagle-llama3-70b", "eagle3-llama3-8b", "medusa2-llama3-8b", "draft-llama3-70b"]


def _kept(r):
    tr = r.training
    return {"method": r.method, "speculator": r.speculator.model_dump() if r.speculator else None,
            "zero_stage": zero_stage(r), "deepspeed": r.launcher.deepspeed, "placement": r.target.placement,
            "hidden_states": r.data.hidden_states, "ttt_steps": tr.ttt_steps, "grad_accum": tr.grad_accum,
            "gradient_checkpointing": tr.gradient_checkpointing, "position_weight_decay": tr.position_weight_decay,
            "loss_on_prompt": r.data.loss_on_prompt, "temperatures": r.evaluation.temperatures,
            "depth": r.evaluation.depth}


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_smoke_overrides_swap_only_what_the_machine_cannot_hold(name):
    full = resolve(load_recipe(name))
    smoke = resolve(load_recipe(name, overrides=smoke_overrides(name)))
    a, b = _kept(full), _kept(smoke)
    if full.method == "draft":  # the pretrained draft is swapped for a tiny one of its family
        a["speculator"].pop("init_from"), b["speculator"].pop("init_from")
    assert a == b
    # the stand-in target is of the target's family (model type, tied or untied LM head, GQA)
    big, tiny = find_architecture(full.target.name), find_architecture(smoke.target.name)
    assert tiny.model_type == big.model_type and tiny.tie_word_embeddings == big.tie_word_embeddings
    assert tiny.num_key_value_heads < tiny.num_attention_heads
    assert smoke.target.device == "cpu" and smoke.launcher.config == "zero-cpu-2proc"
    assert smoke.launcher.num_processes == 2 and smoke.tracking.wandb_mode == "offline"
    assert smoke.training.max_steps == 2 and smoke.training.checkpoint_every == 1
    assert [p.source for p in smoke.data.prompts] == ["file"]
    if full.method == "eagle3":  # the draft vocabulary logic runs at the recipe's size
        assert smoke.speculator.draft_vocab_size == 32000 < tiny.vocab_size
    # everything a run checks first passes on this machine, and the plan is made from the stand-in
    assert not failures(preflight(smoke)), [c.line() for c in failures(preflight(smoke))]
    assert make_plan(smoke).memory.total < 2e9


def _smoke(name, tmp_path, *extra, timeout=600):
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "specfoundry.runtime.cli", "train", name, "--smoke",
                           "--set", f"output_dir={run}", "--set", f"data.cache_dir={tmp_path / 'cache'}", *extra],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[smoke] " in proc.stderr
    return run, proc


def _check_run(run: Path, name: str):
    resolved = (run / "recipe.resolved.yaml").read_text()
    assert f"name: {name}" in resolved
    assert len(list((run / "checkpoints").glob("step-*"))) == 2  # checkpoint_every 1, 2 steps
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["tokens_trained"] > 0 and summary["wandb_mode"] == "offline"
    assert summary["measured"]["builtin-heldout"]["T=0"]["identical_rate"] == 1.0  # lossless
    assert list((run / "wandb").glob("offline-run-*"))
    report = json.loads((run / "export" / "export_report.json").read_text())
    assert report["written"], report
    return summary, report


@pytest.fixture(scope="module")
def smoke_70b(tmp_path_factory):
    """eagle-llama3-70b --smoke on one machine (2 processes): shared by the end-to-end test and
    the 2-machine comparison (which reuses its data cache)."""
    tmp = tmp_path_factory.mktemp("smoke-70b")
    return (tmp, *_smoke("eagle-llama3-70b", tmp))


def test_eagle_llama3_70b_smoke_trains_evaluates_and_exports_on_cpu(smoke_70b):
    from specfoundry.runtime.speculators import read_config

    _tmp, run, proc = smoke_70b
    assert "zero-cpu-2proc.yaml --deepspeed_config_file" in proc.stderr and "zero3.json" in proc.stderr
    assert "--num_processes 2" in proc.stderr
    summary, report = _check_run(run, "eagle-llama3-70b")
    cfg = read_config(run / "speculator")
    assert cfg["speculator_type"] == "eagle3" and cfg["architecture"]["draft_vocab_size"] == 32000
    resolved = (run / "recipe.resolved.yaml").read_text()
    assert "ttt_steps: 7" in resolved and "placement: zero3" in resolved and "hidden_states: online" in resolved
    # both ranks' ZeRO-3 shards are in the checkpoint
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert list(ckpt.rglob("*rank_1*")), sorted(p.name for p in ckpt.rglob("*"))
    assert "vllm" in report["written"] and "sglang" in report["written"]
    _check_target_partitioned(run, summary, proc.stderr)
    assert all(bool(t.isfinite().all()) for t in _tensors(run / "speculator").values())


def _check_target_partitioned(run: Path, summary: dict, stderr: str):
    """target.placement zero3 really partitioned the frozen target: each of the 2 ranks held half
    of the elements of every parameter but the LM head (whole copies: LM head, embedding), as the
    ranks reported them (train_summary.json and each rank's [target] log line)."""
    import yaml

    from specfoundry.runtime import load_target

    placed = summary["target_placement"]
    assert placed["placement"] == "zero3", placed
    ranks = placed["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["world"] == 2 for r in ranks)
    whole = load_target(yaml.safe_load((run / "recipe.resolved.yaml").read_text())["target"]["name"], backend="hf")
    total = sum(p.numel() for p in whole.model.parameters())
    for r in ranks:
        assert r["partitioned_elements"] > 0
        assert r["fraction_this_rank"] == pytest.approx(0.5, abs=0.01), r
        assert 2 * r["elements_this_rank"] >= r["partitioned_elements"] > 1.9 * r["elements_this_rank"]
        assert r["partitioned_elements"] == total - whole.lm_head.weight.numel()
        assert f"[target] rank {r['rank']}/2: {r['elements_this_rank']} of {r['partitioned_elements']}" in stderr
    # the whole target of the data phase and the partitioned one were freed when their phase ended
    assert "[target] warning" not in stderr, [ln for ln in stderr.splitlines() if "[target] warning" in ln]


def test_zero3_placement_trains_what_replicate_placement_trains(smoke_70b, tmp_path):
    """The same smoke run with the frozen target whole in every process (target.placement:
    replicate; same data cache, same seed) trains the same speculator, within float tolerance
    (measured bit-identical on the 2-core CPU), and ends with the same metrics."""
    import torch

    single_tmp, z3_run, _ = smoke_70b
    run, _proc = _smoke("eagle-llama3-70b", tmp_path, "--set", "target.placement=replicate",
                        "--set", f"data.cache_dir={single_tmp / 'cache'}")
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["target_placement"] == {"placement": "replicate"}
    z3 = json.loads((z3_run / "train_summary.json").read_text())
    assert summary["tokens_trained"] == z3["tokens_trained"] and summary["sequences"] == z3["sequences"]
    for k, v in z3["final_metrics"].items():
        assert summary["final_metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    a, b = _tensors(z3_run / "speculator"), _tensors(run / "speculator")
    assert a.keys() == b.keys()
    bad = [k for k in a if not torch.allclose(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-6)]
    assert not bad, bad


@pytest.mark.parametrize("name", ["eagle3-llama3-8b", "medusa2-llama3-8b", "draft-llama3-70b"])
def test_other_gpu_recipes_smoke_end_to_end(tmp_path, name):
    run, _ = _smoke(name, tmp_path)
    _summary, report = _check_run(run, name)
    if name == "medusa2-llama3-8b":  # merge: true -> the fine-tuned backbone beside the heads
        assert (run / "target" / "config.json").exists() and "trtllm" in report["written"]
    if name == "draft-llama3-70b":  # init_from a (tiny) pretrained draft under ZeRO-3: full weights saved
        from specfoundry.runtime import load_target

        draft = load_target(str(run / "speculator"), backend="hf")
        assert all(float(p.abs().sum()) > 0 for p in draft.model.parameters())
        assert "hf_draft" in report["written"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(spec_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(spec_dir / "model.safetensors"))


def test_two_machine_launch_equals_the_single_machine_run(smoke_70b, tmp_path):
    """Multi-node: two launches on 127.0.0.1 (machine_rank 0 and 1, one process each, gloo, the
    same `specfoundry train --smoke` command with launcher.num_machines=2) train the same
    speculator, bit for bit, as the single-machine 2-process run."""
    single_tmp, single_run, _ = smoke_70b
    port = _free_port()
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "specfoundry.runtime.cli", "train", "eagle-llama3-70b", "--smoke",
               "--set", f"output_dir={run}", "--set", f"data.cache_dir={single_tmp / 'cache'}",
               "--set", "launcher.num_machines=2", "--set", f"launcher.machine_rank={rank}",
               "--set", "launcher.main_process_ip=127.0.0.1", "--set", f"launcher.main_process_port={port}"]
        # output to files, not pipes: a full pipe of one machine would stall its rank and hang the other
        log = open(tmp_path / f"machine{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    try:
        for p, log in procs:
            p.wait(timeout=600)
            log.close()
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    outs = [("", (tmp_path / f"machine{rank}.log").read_text()) for rank in (0, 1)]
    procs = [p for p, _ in procs]
    for rank, (p, (_out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"machine {rank}:\n{err[-4000:]}"
    err0 = outs[0][1]
    assert "--num_machines 2" in err0 and "--machine_rank 0" in err0 and f"--main_process_port {port}" in err0
    assert "--machine_rank 1" in outs[1][1]
    assert "2 steps of 2 x 2 process(es)" in err0  # one process per machine, a world of 2
    a, b = _tensors(single_run / "speculator"), _tensors(run / "speculator")
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a), [k for k in a if not (a[k] == b[k]).all()]
    # the main machine exported; the other did not
    assert (run / "export" / "export_report.json").exists() and "[smoke] {" not in outs[1][1]
