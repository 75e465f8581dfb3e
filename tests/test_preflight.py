"""Preflight (specfoundry.train.preflight): what a recipe needs from this machine, checked before
anything is launched, one line per failure; the dry run shows the same checks. No GPU, no network:
CUDA devices are a fake probe, the Hub is an offline cache the test builds."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from specfoundry.train.launcher import launch_args
from specfoundry.train.preflight import failures, format_checks, preflight
from specfoundry.train.recipe import RecipeError, load_recipe, resolve

GB = 1e9
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _probe(n, free_gb=80.0):
    return lambda: (n, [(free_gb * GB, 80 * GB)] * n, "fake")


def _by_name(checks):
    out = {}
    for c in checks:
        out.setdefault(c.name, c)
    return out


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def _cache_files(hub, repo, commit=COMMIT, weights=True):
    """A Hub cache entry (files only: preflight reads the layout and config, not the weights)."""
    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if weights:
        (snap / "model.safetensors").write_bytes(b"")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)


def test_the_70b_recipe_fails_in_one_line_before_spawning_anything(tmp_path):
    """The issue's first usage line on a machine without 8 GPUs: one clear line, exit 2, nothing launched."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_CACHE": str(tmp_path / "hub")}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "specfoundry.runtime.cli", "train", "eagle-llama3-70b"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "needs 8 CUDA GPU(s)" in lines[0] and "--smoke" in lines[0]
    assert "accelerate" not in res.stderr and "Traceback" not in res.stderr
    assert time.perf_counter() - t0 < 60


def test_devices_and_memory_against_the_plan():
    r = load_recipe("eagle-llama3-70b")
    # placement zero3: the run partitions the 141 GB target over the 8 processes (train/zero3_target.py),
    # so the intended 8 x 80 GB machine passes, with the per-process share named
    ok = _by_name(preflight(r, cuda_probe=_probe(8)))
    assert ok["devices"].status == "ok" and ok["memory"].status == "ok", ok["memory"].detail
    assert "target partitioned by ZeRO-3: 21.6 GB of its 141.1 GB per process" in ok["memory"].detail
    # ... and the main process's phases with the whole target fit spread over the 8 GPUs (17.6 + 2 GB each)
    main = ok["main-process memory"]
    assert main.status == "ok" and "whole 141.1 GB target over this machine's 8 GPUs" in main.detail
    assert "~19.6 GB per GPU" in main.detail
    tight = _by_name(preflight(r, cuda_probe=_probe(8, free_gb=60)))  # training fits 54 GB; data phase fits too
    assert tight["memory"].status == "ok" and tight["main-process memory"].status == "ok"
    # the same recipe with the target whole in every process (replicate) does not fit 80 GB
    rep = _by_name(preflight(load_recipe("eagle-llama3-70b", {"target.placement": "replicate"}), cuda_probe=_probe(8)))
    assert rep["memory"].status == "fail" and "GB per device" in rep["memory"].detail
    assert _by_name(preflight(r, cuda_probe=_probe(8, free_gb=200)))["memory"].status == "ok"
    assert _by_name(preflight(load_recipe("eagle3-llama3-8b"), cuda_probe=_probe(8)))["memory"].status == "ok"
    few = _by_name(preflight(r, cuda_probe=_probe(4)))
    assert few["devices"].status == "fail" and "needs 8 CUDA GPU(s)" in few["devices"].detail and "found 4" in few["devices"].detail
    small = _by_name(preflight(r, cuda_probe=_probe(8, free_gb=24)))
    assert small["memory"].status == "fail" and "GB per device" in small["memory"].detail
    # a 2-machine launch needs only its share of the processes on each machine
    two = load_recipe("eagle-llama3-70b", overrides={"launcher.num_processes": 16, "launcher.num_machines": 2,
                                                     "launcher.config": "multinode-example"})
    assert _by_name(preflight(two, cuda_probe=_probe(8)))["devices"].status == "ok"


def test_zero3_main_process_phases_need_the_whole_target_on_one_machine():
    """The whole 70B target (data generation, final evaluation in the main process) fits 8 x 80 GB
    spread by device_map, not one 80 GB GPU: that machine is refused with the reason."""
    from specfoundry.train.plan import make_plan
    from specfoundry.train.preflight import _main_process_check

    plan = make_plan(load_recipe("eagle-llama3-70b"))
    assert _main_process_check(plan, [(80 * GB, 80 * GB)] * 8).status == "ok"
    one = _main_process_check(plan, [(80 * GB, 80 * GB)])
    assert one.status == "fail" and "on its one GPU" in one.detail and "~143.1 GB per GPU" in one.detail


def test_hub_target_offline_and_not_cached_is_the_hub_line(offline_hub):
    r = load_recipe("eagle-llama3-70b")
    target = _by_name(preflight(r, cuda_probe=_probe(8)))["target"]
    assert target.status == "fail" and "\n" not in target.detail
    assert "HF_HUB_OFFLINE=1" in target.detail and "hf download meta-llama/Llama-3.3-70B-Instruct" in target.detail


def test_hub_target_in_the_cache_and_revision_pinning(offline_hub):
    _cache_files(offline_hub, "meta-llama/Llama-3.3-70B-Instruct")
    r = load_recipe("eagle-llama3-70b")
    assert _by_name(preflight(r, cuda_probe=_probe(8)))["target"].status == "ok"
    pinned = load_recipe("eagle-llama3-70b", overrides={"target.revision": COMMIT})
    assert resolve(pinned).target.revision == COMMIT
    assert _by_name(preflight(pinned, cuda_probe=_probe(8)))["target"].status == "ok"
    other = load_recipe("eagle-llama3-70b", overrides={"target.revision": "v9"})
    bad = _by_name(preflight(other, cuda_probe=_probe(8)))["target"]
    assert bad.status == "fail" and "Llama-3.3-70B-Instruct@v9" in bad.detail


def test_hub_target_without_safetensors_is_refused(offline_hub):
    _cache_files(offline_hub, "meta-llama/Llama-3.3-70B-Instruct", weights=False)
    bad = _by_name(preflight(load_recipe("eagle-llama3-70b"), cuda_probe=_probe(8)))["target"]
    assert bad.status == "fail" and "safetensors" in bad.detail


def test_the_dry_run_never_downloads_a_missing_hub_target(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    c = _by_name(preflight(load_recipe("eagle-llama3-70b"), cuda_probe=_probe(8)))["target"]
    assert c.status == "warn" and "a real run downloads it" in c.detail


def test_missing_prompt_file_and_draft_model(tmp_path, offline_hub):
    r = load_recipe("eagle3-llama3-8b")  # a ShareGPT file that is not in the repository
    data = [c for c in preflight(r, cuda_probe=_probe(8)) if c.name == "data" and "ShareGPT" in c.detail]
    assert data[0].status == "fail" and "data.prompts[1]" in data[0].detail and "not found" in data[0].detail
    d = load_recipe("draft-llama3-70b")
    checks = preflight(d, cuda_probe=_probe(8))
    draft = _by_name(checks)["draft"]
    assert draft.status == "fail" and "Llama-3.2-1B-Instruct" in draft.detail
    # hub prompt data offline and not cached is a failure too
    hub_data = [c for c in checks if c.name == "data"][0]
    assert hub_data.status == "fail" and "ultrachat_200k" in hub_data.detail


def test_deepspeed_config_must_agree_with_the_process_count(tmp_path):
    from specfoundry.train.launcher import read_deepspeed_config

    ds = read_deepspeed_config("zero2")
    ds["train_batch_size"] = 64  # written for 8 processes
    path = tmp_path / "fixed.json"
    path.write_text(json.dumps(ds))
    r = load_recipe("eagle3-llama3-8b", overrides={"launcher.deepspeed": str(path), "launcher.num_processes": 4})
    bad = [c for c in preflight(r, cuda_probe=_probe(8)) if c.name == "launcher"]
    assert bad[0].status == "fail" and "train_batch_size is 64" in bad[0].detail and "32" in bad[0].detail


def test_offline_features_need_disk(monkeypatch):
    import shutil
    from collections import namedtuple

    r = load_recipe("eagle3-smollm2-135m")
    ok = _by_name(preflight(r))["disk"]
    assert ok.status == "ok"
    # the batched engine store keeps generation's states as well: twice a captured store's bytes
    alone = _by_name(preflight(load_recipe("eagle3-smollm2-135m", overrides=["data.capture_batch_size=1"])))["disk"]
    gb = [float(re.search(r"~([0-9.]+) GB", c.detail).group(1)) for c in (ok, alone)]
    assert "states generation keeps" in ok.detail and "states" not in alone.detail
    assert gb[0] == pytest.approx(2 * gb[1], abs=0.011)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9, 1000))
    disk = _by_name(preflight(r))["disk"]
    assert disk.status == "fail" and "not enough disk" in disk.detail


def test_default_recipe_passes_on_this_machine_and_the_dry_run_shows_the_checks(capsys):
    from specfoundry.runtime.cli import main

    assert not failures(preflight(load_recipe("eagle3-smollm2-135m")))
    assert main(["train", "eagle-llama3-70b", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "preflight (this machine):" in out and "devices" in out and "launcher" in out
    assert "plan for recipe eagle-llama3-70b" in out
    text = format_checks(preflight(load_recipe("eagle-llama3-70b"), cuda_probe=_probe(0)))
    assert "FAIL devices" in text


def test_multinode_launch_arguments_and_checks():
    r = resolve(load_recipe("eagle-llama3-70b", overrides={
        "launcher.config": "multinode-example", "launcher.num_processes": 16, "launcher.num_machines": 2,
        "launcher.machine_rank": 1, "launcher.main_process_ip": "10.1.2.3", "launcher.main_process_port": 29555}))
    args = launch_args(r)
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--num_machines"] == "2" and pairs["--num_processes"] == "16"
    assert pairs["--machine_rank"] == "1" and pairs["--main_process_ip"] == "10.1.2.3"
    assert pairs["--main_process_port"] == "29555"
    # the accelerate config's address is the default
    r0 = resolve(load_recipe("eagle-llama3-70b", overrides={"launcher.config": "multinode-example",
                                                            "launcher.num_processes": 16, "launcher.num_machines": 2}))
    pairs0 = dict(zip(launch_args(r0)[::2], launch_args(r0)[1::2]))
    assert pairs0["--machine_rank"] == "0" and pairs0["--main_process_ip"] == "10.0.0.1"
    with pytest.raises(RecipeError, match="machine_rank 2 with 2 machine"):
        load_recipe("eagle-llama3-70b", overrides={"launcher.config": "multinode-example",
                                                   "launcher.num_processes": 16, "launcher.num_machines": 2,
                                                   "launcher.machine_rank": 2})
    # one machine: no multi-node arguments
    assert "--machine_rank" not in launch_args(resolve(load_recipe("eagle3-smollm2-135m")))


def test_a_real_run_fetches_a_missing_hub_target_once_and_only_when_all_else_passed(tmp_path, monkeypatch):
    """allow_download (a real run): the Hub is asked in the launching process, once, and only when
    every other check passed; its failure is the runtime's one HubError line."""
    from specfoundry.runtime import models

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def gated(repo, revision=None):
        calls.append((repo, revision))
        raise models.HubError(f"{repo} is a gated model: accept its license on https://huggingface.co/{repo} and "
                              "set HF_TOKEN (or run `hf auth login`)")

    monkeypatch.setattr(models, "hub_snapshot", gated)
    r = load_recipe("eagle3-llama3-8b", overrides={"data.prompts": [{"source": "magpie", "count": 4096}]})
    ok_devices = _probe(8, free_gb=80)
    target = _by_name(preflight(r, cuda_probe=ok_devices, allow_download=True))["target"]
    assert calls == [("meta-llama/Llama-3.1-8B-Instruct", None)]
    assert target.status == "fail" and "gated model" in target.detail and "HF_TOKEN" in target.detail
    # with a device failure nothing is fetched (the run could not start anyway)
    calls.clear()
    target = _by_name(preflight(r, cuda_probe=_probe(0), allow_download=True))["target"]
    assert calls == [] and target.status == "warn"


def test_a_multi_cpu_config_that_would_start_one_process_is_refused():
    """accelerate starts a MULTI_CPU config's processes through mpirun only: ddp-2proc with 2
    processes would silently train in 1; the preflight says so (zero-cpu-2proc runs 2 through torchrun)."""
    r = load_recipe("eagle3-smollm2-135m", overrides={"launcher.config": "ddp-2proc", "launcher.num_processes": 2})
    bad = [c for c in preflight(r) if c.name == "launcher"]
    assert bad[0].status == "fail" and "would start 1 process, not 2" in bad[0].detail
