"""``specfoundry train <recipe> --smoke``: a GPU recipe's code path, end to end, on a CPU.

The smoke run is the recipe itself with one documented set of overrides (``--set`` lines, so
every launched process sees the same recipe) that swap only what a laptop or CI machine cannot
hold, and keep everything else:

swapped (what the machine cannot hold)
  - ``target.name``: a tiny random model of the target's architecture family (its
    ``model_type``, GQA, tied or untied LM head, as the recipe's target has them: 8 layers,
    hidden 64) with the built-in SmolLM2 tokenizer and chat template, written once to
    ``$SPECFOUNDRY_CACHE/smoke/`` (seeded: the same bytes every time); ``target.revision`` unset.
  - ``speculator.init_from`` (draft recipes): a tiny random draft of the draft's family the same way.
  - devices and precision: ``target.device: cpu``, fp32 target/responses/training (bf16 mixed
    precision under DeepSpeed needs a GPU), ``launcher.device_memory_gb`` unset.
  - the launcher: a DeepSpeed recipe runs the CPU DeepSpeed config ``zero-cpu-2proc`` with the
    recipe's own ZeRO JSON (stage kept), 2 processes over gloo; any other one ``single-cpu``
    (accelerate starts plain CPU data parallelism only through mpirun).
  - data volume: the prompt sources become one 12-prompt local file (no network; a random target
    cannot write Magpie prompts); 16-token self-distilled responses, ``max_seq_len`` 64, 2 held out.
  - schedule and evaluation size: 2 steps of micro-batch 2 (``grad_accum`` kept), a checkpoint
    and an evaluation every step, 1 warm-up step; evaluation on 2 prompts, 16 tokens; no
    ``max_minutes`` budgets; output in ``runs/smoke/<recipe>``, data cache beside the tiny target.
  - tracking: W&B offline.

kept: method, speculator options (EAGLE-3 draft vocabulary and its d2t/t2d logic, Medusa heads,
LoRA and its merge, KD loss), ZeRO stage and the target placement (``zero3``: the tiny target is
really partitioned over the 2 processes, train/zero3_target.py), online/offline hidden states,
``ttt_steps``, ``grad_accum``, gradient checkpointing, checkpointing, evaluation temperatures and
depth, and the export of the result (``specfoundry export`` of the serving formats).

Overrides given with ``--set`` after ``--smoke`` still win (e.g. ``--set launcher.num_processes=1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

__all__ = ["SMOKE_PROMPTS", "smoke_overrides", "smoke_root", "tiny_model_dir", "export_result"]

SMOKE_PROMPTS = ["Write a haiku about rain.", "What is 2 + 2?", "Name three colors.", "Explain gravity briefly.",
                 "Give me a synonym for happy.", "Translate 'cat' to French.", "List two prime numbers.",
                 "What is the capital of Italy?", "Say hello politely.", "Describe a cat in one sentence.",
                 "Count to five.", "Why is the sea salty?"]

# shape of the tiny stand-ins (8 layers: EAGLE-3's default feature layers 2, L//2, L-3 stay distinct)
TINY = {"hidden_size": 64, "num_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128}
TINY_DRAFT_LAYERS = 2
# what the smoke run exports (export.serving.SERVING_FORMATS; each type writes the ones it has)
SERVING_FORMATS = "vllm,sglang,trtllm,hf_draft"


def smoke_root() -> Path:
    from .presets import cache_root

    return cache_root() / "smoke"


def _family(name: str):
    """The architecture of ``name`` (preset, local dir or cached built-in); None when unknown."""
    from .presets import PresetError, find_architecture

    try:
        return find_architecture(name)
    except PresetError:
        return None


def tiny_model_dir(family_of: str, *, layers: int | None = None, seed: int = 0) -> Path:
    """A tiny random causal LM of ``family_of``'s architecture family with SmolLM2's tokenizer,
    written once (atomically) under :func:`smoke_root` and reused."""
    arch = _family(family_of)
    model_type = arch.model_type if arch is not None else "llama"
    tied = arch.tie_word_embeddings if arch is not None else False
    L = layers or TINY["num_layers"]
    spec = {"model_type": model_type, "tied": tied, "layers": L, "seed": seed, **TINY}
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    out = smoke_root() / "models" / f"tiny-{model_type}-{L}l-{'tied' if tied else 'untied'}-{key}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from specfoundry.runtime.atomic import atomic_dir
    from specfoundry.runtime.models import builtin_model_dir

    tok_dir = builtin_model_dir("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    try:
        cfg = AutoConfig.for_model(model_type)
    except ValueError:  # an architecture transformers does not know by name: Llama-shaped
        cfg = AutoConfig.for_model("llama")
    cfg.update(dict(vocab_size=len(tok), hidden_size=TINY["hidden_size"], intermediate_size=TINY["intermediate_size"],
                    num_hidden_layers=L, num_attention_heads=TINY["num_attention_heads"],
                    num_key_value_heads=TINY["num_key_value_heads"], max_position_embeddings=512,
                    tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id))
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with atomic_dir(out, lambda p: True, "a smoke-test model directory") as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    print(f"[smoke] wrote a tiny random {model_type} ({L} layers, hidden {TINY['hidden_size']}) to {out}",
          file=sys.stderr)
    return out


def _raw_recipe(name_or_path: str) -> dict:
    from .recipe import _load_yaml, recipe_path

    path = recipe_path(name_or_path)
    data = _load_yaml(path.read_text(), str(path))
    return data if isinstance(data, dict) else {}


def _yaml(value) -> str:
    return json.dumps(value)  # JSON is YAML: lists and mappings survive --set parsing


def smoke_overrides(name_or_path: str, processes: int = 2) -> list[str]:
    """The ``--set KEY=VALUE`` lines that make recipe ``name_or_path`` a CPU smoke run (see the
    module docstring); writes the tiny target (and draft) on first use."""
    from .recipe import load_recipe

    recipe = load_recipe(name_or_path)
    raw = _raw_recipe(name_or_path)
    name = recipe.name
    root = smoke_root()
    sets: dict[str, object] = {}
    sets["target.name"] = str(tiny_model_dir(recipe.target.name))
    sets["target.revision"] = None
    sets["target.device"] = "cpu"
    sets["target.dtype"] = "fp32"
    init_from = getattr(recipe.speculator, "init_from", None)
    if init_from:
        sets["speculator.init_from"] = str(tiny_model_dir(init_from, layers=TINY_DRAFT_LAYERS, seed=1))
    # data: no network, a few prompts
    root.mkdir(parents=True, exist_ok=True)
    prompts_file = root / "prompts.jsonl"
    text = "\n".join(json.dumps({"prompt": p}) for p in SMOKE_PROMPTS) + "\n"
    if not prompts_file.is_file() or prompts_file.read_text() != text:
        prompts_file.write_text(text)
    # every source becomes one local file: hub/file data is not here, and a random target writes
    # no usable Magpie prompts (its samples never end, so all are dropped after minutes of sampling)
    sets["data.prompts"] = [{"source": "file", "path": str(prompts_file), "limit": len(SMOKE_PROMPTS)}]
    sets["data.responses.max_new_tokens"] = 16
    sets["data.responses.batch_size"] = 8
    sets["data.responses.dtype"] = "fp32"
    sets["data.max_seq_len"] = 64
    sets["data.eval_prompts"] = 2
    sets["data.cache_dir"] = str(root / "data" / name)
    sets["data.max_minutes"] = None
    # schedule
    sets.update({"training.max_steps": 2, "training.epochs": None, "training.batch_size": 2,
                 "training.warmup_steps": 1, "training.checkpoint_every": 1, "training.eval_every": 1,
                 "training.log_every": 1, "training.max_minutes": None, "training.precision": "fp32"})
    # launcher: CPU, gloo, the recipe's ZeRO stage
    ln = recipe.launcher
    if ln.deepspeed is not None:
        sets["launcher.config"] = "zero-cpu-2proc"
        n = processes
    else:  # plain DDP on CPU: accelerate starts CPU DDP through mpirun only, so one process here
        sets["launcher.config"] = "single-cpu"
        n = 1
    sets.update({"launcher.num_processes": n, "launcher.num_machines": 1, "launcher.device_memory_gb": None,
                 "launcher.machine_rank": None, "launcher.main_process_ip": None, "launcher.main_process_port": None})
    sets["tracking.wandb_mode"] = "offline"
    sets.update({"evaluation.limit": 2, "evaluation.max_new_tokens": 16, "evaluation.max_minutes": None})
    if not raw.get("output_dir"):
        sets["output_dir"] = f"runs/smoke/{name}"
    return [f"{k}={_yaml(v) if not isinstance(v, str) else v}" for k, v in sets.items()]


def export_result(recipe) -> dict:
    """Export a finished smoke run's speculator to the serving formats (``specfoundry export <run>``,
    run as the command: training code does not import the export package); returns
    ``export_report.json``'s content."""
    import subprocess

    run = Path(recipe.output_dir)
    target = recipe.target.name
    if recipe.method == "medusa2":  # the heads belong to the fine-tuned backbone the run wrote
        target = str(run / ("target" if (run / "target").is_dir() else "adapter"))
    cmd = [sys.executable, "-m", "specfoundry.runtime.cli", "export", str(run), "--formats", SERVING_FORMATS,
           "--target", target]
    print("[smoke] " + " ".join(cmd), file=sys.stderr)
    code = subprocess.call(cmd, env=smoke_env())
    if code != 0:
        raise RuntimeError(f"export of {run} failed (exit {code})")
    return json.loads((run / "export" / "export_report.json").read_text())


def smoke_env() -> dict:
    """The launched processes' environment for a smoke run (W&B offline, one thread each)."""
    env = os.environ.copy()
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_smoke(args, recipe) -> int:
    """Launch the smoke run exactly as ``specfoundry train`` launches the recipe (in process for
    one process without DeepSpeed, else ``accelerate launch``), then export the result. The
    smoke run directory is a scratch one: an earlier smoke run there is replaced."""
    import subprocess

    from .recipe import launch_args

    extra = (["--resume"] if args.resume else ["--overwrite"]) + [x for kv in args.set for x in ("--set", kv)]
    if (recipe.launcher.num_processes or 1) == 1 and recipe.launcher.deepspeed is None:
        from .run import main

        os.environ.setdefault("WANDB_MODE", "offline")
        code = main([args.recipe, *extra])
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args(recipe), "-m",
               "specfoundry.train.run", args.recipe, *extra]
        print("[smoke] " + " ".join(cmd), file=sys.stderr)
        code = subprocess.call(cmd, env=smoke_env())
    if code != 0:
        return code
    if (recipe.launcher.machine_rank or 0) != 0:  # the main machine exports; the others are done
        return 0
    report = export_result(recipe)
    summary_file = Path(recipe.output_dir) / "train_summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    line = {"recipe": recipe.name, "smoke": True, "run": recipe.output_dir, "steps": summary.get("steps"),
            "measured": {s: {t: (round(v["tau"], 3) if v.get("tau") is not None else None) for t, v in per.items()}
                         for s, per in (summary.get("measured") or {}).items()},
            "exported": sorted(report.get("written", {})), "export_skipped": sorted(report.get("skipped", {}))}
    print("[smoke] " + json.dumps(line), file=sys.stderr)
    return 0
