"""The prepared GPU run (``make gpu-run``, tools/gpu_run.py): without a GPU every section
but ``env`` says "skipped" with the reason and the command succeeds; the decode sections' code (HF
path, engine, engine behind GraphedTarget, which runs its static step eagerly off CUDA) is checked
on the CPU with a tiny target."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specfoundry.runtime.models import builtin_model_dir

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_run.py"


def _gpu_run_module():
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_every_section_is_skipped_and_it_succeeds(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_run.json").read_text())
    assert json.loads(res.stdout) == summary and summary["ok"]
    secs = summary["sections"]
    assert list(secs) == ["env", "train", "decode_hf", "decode_engine", "decode_graphs", "tree_attention", "tensorrt"]
    assert secs["env"]["status"] == "ok" and secs["env"]["details"]["cuda_available"] is False
    for name, rec in secs.items():
        if name != "env":
            assert rec["status"] == "skipped" and "no CUDA device" in rec["reason"], (name, rec)


def test_decode_sections_run_on_cpu_with_a_tiny_target(tmp_path):
    d = tmp_path / "tiny"
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(builtin_model_dir("smollm2-135m"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    main = _gpu_run_module().main
    out = tmp_path / "out"
    assert main(["--out", str(out), "--device", "cpu", "--sections", "decode_hf,decode_engine,decode_graphs",
                 "--target", str(d), "--prompts", "1", "--max-new-tokens", "12"]) == 0
    secs = json.loads((out / "gpu_run.json").read_text())["sections"]
    for name, backend in (("decode_hf", "TargetModel"), ("decode_engine", "EngineTarget"),
                          ("decode_graphs", "EngineTarget+cuda_graphs")):
        rec = secs[name]
        assert rec["status"] == "ok", rec
        det = rec["details"]
        assert det["backend"] == backend and det["identical"] == "1/1" and det["tau"] >= 1.0 and det["speedup"] > 0
        # the speed-up comes from the second (warm) round; the first is reported beside it
        assert det["lossless"] == "1/1" and set(det["cold_round_s"]) == {"plain", "speculative"}
    assert secs["train"]["status"] == "skipped"


def test_the_cuda_training_section_is_a_valid_recipe_that_passes_preflight_on_one_gpu(tmp_path):
    """Its `specfoundry train` overrides validate, and the preflight passes with one (fake) GPU."""
    from specfoundry.train.preflight import failures, preflight
    from specfoundry.train.recipe import load_recipe, resolve

    sets = _gpu_run_module().train_overrides(tmp_path)
    r = resolve(load_recipe("eagle3-smollm2-135m", overrides=[f"{k}={v}" for k, v in sets.items()]))
    assert r.target.device == "cuda" and r.training.precision == "bf16" and r.launcher.num_processes == 1
    assert r.data.prompts[0].count == 128 and r.evaluation.temperatures == [0.0]
    checks = preflight(r, cuda_probe=lambda: (1, [(100e9, 141e9)], "fake"))
    assert not failures(checks), [c.line() for c in failures(checks)]


def test_the_tree_attention_section_functions_on_cpu():
    """Section 6's two measurements at toy sizes on the CPU: the verify-cost curve of a random
    Llama on the engine, and the Triton kernel vs SDPA (Triton's interpreter, in a subprocess:
    TRITON_INTERPRET must be set before triton is imported)."""
    mod = _gpu_run_module()
    cfg = dict(mod.LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=256)
    ms = mod.verify_cost(cfg, "cpu", torch.float32, past=16, ns=(1, 4), reps=2)
    assert set(ms) == {1, 4} and all(v > 0 for v in ms.values())
    code = ("import importlib.util, json, torch\n"
            f"spec = importlib.util.spec_from_file_location('gpu_run', {str(SCRIPT)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "print(json.dumps(m.attention_compare('cpu', torch.float32, 4, 2, 16, 8, ns=(1, 5), reps=1)))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"1", "5"} and all(r["max_abs_diff"] < 1e-4 for r in out.values()), out


def test_the_sdpa_new_length_probe_runs_the_engine_attention_on_cpu():
    """The probe of first-seen vs repeated key lengths (CUDA's per-shape setup) runs the engine's
    own attention under both backend settings and leaves the module's setting as it was."""
    import torch

    from specfoundry.runtime import kvcache

    was = kvcache.CUDA_SDPA_BACKENDS
    out = _gpu_run_module().sdpa_new_lengths("cpu", torch.float32, lengths=range(40, 42), reps=1)
    assert set(out) == {"pytorch_choice", "engine"} and kvcache.CUDA_SDPA_BACKENDS == was
    assert all(v["first_ms"] > 0 and v["again_ms"] > 0 for v in out.values())
