"""Launcher configs of a recipe: the packaged accelerate YAMLs and DeepSpeed JSONs, and what a
recipe's ``launcher`` section makes of them.

Scope: locating the configs (``recipes/accelerate/*.yaml``, ``recipes/deepspeed/*.json``, or
paths), reading them, the launcher cross-checks the recipe schema runs (:func:`launcher_problems`),
the ``accelerate launch`` arguments (:func:`launch_args`) and the DeepSpeed config with every
``"auto"`` filled from the recipe (:func:`deepspeed_config_for`). It works on any object shaped
like :class:`~specfoundry.train.recipe_schema.Recipe` and imports nothing of the schema (the
schema imports this module). No torch import.

Launching: ``accelerate launch <launch_args(recipe)> -m specfoundry.train <recipe>``. The
DeepSpeed JSON is passed with ``--deepspeed_config_file`` (absolute), which overrides the
relative path written in the accelerate YAML, so installed packages work from any directory.
"""

from __future__ import annotations

import copy
import json
import os
from importlib import resources
from pathlib import Path

import yaml

from .hardware import auto_training_precision
from .recipe_errors import suggest

__all__ = ["packaged", "accelerate_config_path", "deepspeed_config_path", "list_launcher_configs",
           "read_accelerate_config", "read_deepspeed_config", "zero_stage", "launcher_problems", "launch_args",
           "deepspeed_config_for", "process_counts", "machine_settings", "zero3_placement_problem"]


def packaged(*parts: str):
    """A file or folder inside the installed ``specfoundry.recipes`` package."""
    return resources.files("specfoundry.recipes").joinpath(*parts)


def _named_file(value: str, folder: str, ext: str) -> Path:
    """A packaged launcher config by name, or a path (contains '/' or ends with the extension)."""
    if "/" in value or os.sep in value or value.endswith(ext):
        return Path(value).expanduser()
    return Path(str(packaged(folder, value + ext)))


def accelerate_config_path(name_or_path: str) -> Path:
    return _named_file(name_or_path, "accelerate", ".yaml")


def deepspeed_config_path(name_or_path: str) -> Path:
    return _named_file(name_or_path, "deepspeed", ".json")


def list_launcher_configs() -> dict[str, list[str]]:
    """``{"accelerate": [...], "deepspeed": [...]}``: the packaged launcher config names."""
    out = {}
    for folder, ext in (("accelerate", ".yaml"), ("deepspeed", ".json")):
        d = packaged(folder)
        out[folder] = sorted(p.name[: -len(ext)] for p in d.iterdir() if p.name.endswith(ext)) if d.is_dir() else []
    return out


def _read_mapping(path: Path, parse, kind: str) -> dict:
    cfg = parse(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a {kind}")
    return cfg


def read_accelerate_config(name_or_path: str) -> dict:
    return _read_mapping(accelerate_config_path(name_or_path), yaml.safe_load, "YAML mapping")


def read_deepspeed_config(name_or_path: str) -> dict:
    return _read_mapping(deepspeed_config_path(name_or_path), json.loads, "JSON object")


def zero_stage(recipe) -> int:
    """The recipe's ZeRO stage (0 when the launcher does not use DeepSpeed)."""
    if recipe.launcher.deepspeed is None:
        return 0
    return int(read_deepspeed_config(recipe.launcher.deepspeed).get("zero_optimization", {}).get("stage", 0))


def process_counts(recipe) -> tuple[int, int]:
    """``(num_processes, num_machines)``: the recipe's, else its accelerate config's."""
    ln = recipe.launcher
    acc = read_accelerate_config(ln.config)
    return (ln.num_processes or int(acc.get("num_processes", 1)), ln.num_machines or int(acc.get("num_machines", 1)))


def launcher_problems(r) -> list[tuple[str, str]]:
    """Cross-checks between the recipe and its launcher configs, as ``(key path, text)``."""
    ln, out = r.launcher, []
    names = list_launcher_configs()
    acc_path = accelerate_config_path(ln.config)
    if not acc_path.is_file():
        return [("launcher.config", f"no accelerate config {ln.config!r} ({acc_path}); packaged: "
                 f"{', '.join(names['accelerate'])}{suggest(ln.config, names['accelerate'])}")]
    try:
        acc = read_accelerate_config(ln.config)
    except (OSError, ValueError, yaml.YAMLError) as e:
        return [("launcher.config", f"cannot read {acc_path}: {e}")]
    is_ds = acc.get("distributed_type") == "DEEPSPEED"
    stage = 0
    if ln.deepspeed is not None:
        ds_path = deepspeed_config_path(ln.deepspeed)
        if not ds_path.is_file():
            out.append(("launcher.deepspeed", f"no DeepSpeed config {ln.deepspeed!r} ({ds_path}); packaged: "
                        f"{', '.join(names['deepspeed'])}{suggest(ln.deepspeed, names['deepspeed'])}"))
        else:
            try:
                stage = int(read_deepspeed_config(ln.deepspeed).get("zero_optimization", {}).get("stage", 0))
            except (OSError, ValueError) as e:
                out.append(("launcher.deepspeed", f"cannot read {ds_path}: {e}"))
        if not is_ds:
            out.append(("launcher.deepspeed", f"a ZeRO config needs a DeepSpeed launcher, but accelerate config "
                                              f"{ln.config!r} is distributed_type {acc.get('distributed_type')!r} "
                                              "(use zero2, zero3 or multinode-example)"))
    elif is_ds:
        out.append(("launcher.deepspeed", f"accelerate config {ln.config!r} launches DeepSpeed: name its ZeRO config "
                                          "(zero2, zero3, zero3-offload)"))
    nproc = ln.num_processes or int(acc.get("num_processes", 1))
    nmach = ln.num_machines or int(acc.get("num_machines", 1))
    rank = getattr(ln, "machine_rank", None)
    rank = int(acc.get("machine_rank", 0)) if rank is None else int(rank)
    if rank >= nmach:
        out.append(("launcher.machine_rank", f"machine_rank {rank} with {nmach} machine(s) (ranks 0..{nmach - 1})"))
    if nmach > 1 and not (getattr(ln, "main_process_ip", None) or acc.get("main_process_ip")):
        out.append(("launcher.main_process_ip", f"{nmach} machines need the address of machine_rank 0 "
                                                "(launcher.main_process_ip or the accelerate config's)"))
    if nproc % nmach:
        out.append(("launcher.num_processes", f"{nproc} processes do not split evenly over {nmach} machines "
                                              "(num_processes is the total over all machines)"))
    if acc.get("distributed_type") == "NO" and nproc > 1:
        out.append(("launcher.num_processes", f"{nproc} processes with the single-process config {ln.config!r}"))
    use_cpu = bool(acc.get("use_cpu", False))
    if r.training.precision == "fp16" and use_cpu:
        out.append(("training.precision", f"fp16 mixed precision needs CUDA; launcher {ln.config!r} runs on CPU "
                                          "(use bf16 or fp32)"))
    if use_cpu and r.target.device.startswith("cuda"):
        out.append(("target.device", f"{r.target.device} with the CPU launcher {ln.config!r}"))
    pl = r.target.placement
    if pl == "zero3" and stage != 3:
        out.append(("target.placement", "zero3 placement partitions the target with ZeRO-3: set launcher.deepspeed "
                                        "to a stage-3 config (zero3) with a DeepSpeed launcher"))
    if pl == "zero3" and stage == 3:
        problem = zero3_placement_problem(r)
        if problem:
            out.append(("target.placement", problem))
    if pl == "device_map" and nproc > 1:
        out.append(("target.placement", f"device_map spreads one target over the GPUs of one process; "
                                        f"the launcher starts {nproc}"))
    return out


def zero3_placement_problem(r) -> str | None:
    """Why the frozen target cannot be partitioned by ZeRO-3 for this recipe (None: it can).

    A zero3-placement run (train/zero3_target.py) holds the target partitioned during training
    only, where every rank runs the same target forwards; what the main process does alone with
    the target needs it whole, so these combinations are refused (placement ``auto`` falls back
    to ``replicate`` for them): offline hidden states (the capture pass), Medusa-2 (the backbone
    trains through LoRA) and a draft built from target layers (whole layers are copied)."""
    if r.method == "medusa2":
        return ("zero3 placement keeps the target frozen and partitioned, and Medusa-2 fine-tunes it (LoRA): "
                "use target.placement: replicate")
    if r.data.hidden_states == "offline" and r.method != "draft":
        return ("zero3 placement needs data.hidden_states: online (the offline capture pass runs in the main "
                "process alone, with the whole target): use target.placement: replicate for offline features")
    if r.method == "draft" and getattr(r.speculator, "layers", None) is not None:
        return ("zero3 placement: a draft built from target layers (speculator.layers) copies them whole from "
                "the target; use speculator.init_from or speculator.config, or target.placement: replicate")
    return None


def launch_args(recipe) -> list[str]:
    """``accelerate launch`` options for this recipe (config file, DeepSpeed JSON, process counts,
    mixed precision), all paths absolute. CLI options override the accelerate YAML's values."""
    ln = recipe.launcher
    args = ["--config_file", str(accelerate_config_path(ln.config).resolve())]
    if ln.deepspeed is not None:
        args += ["--deepspeed_config_file", str(deepspeed_config_path(ln.deepspeed).resolve())]
    nproc, nmach = process_counts(recipe)
    precision = recipe.training.precision
    if precision == "auto":  # an unresolved recipe: what resolve() fills in
        precision = auto_training_precision("cpu" if read_accelerate_config(ln.config).get("use_cpu") else "cuda")
    args += ["--num_processes", str(nproc), "--num_machines", str(nmach),
             "--mixed_precision", {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]]
    rank, ip, port = machine_settings(recipe)
    if nmach > 1 or getattr(ln, "machine_rank", None) is not None or getattr(ln, "main_process_ip", None) \
            or getattr(ln, "main_process_port", None):
        # accelerate: machine_rank 0 hosts the rendezvous at main_process_ip:main_process_port
        args += ["--machine_rank", str(rank)]
        if ip:
            args += ["--main_process_ip", str(ip)]
        if port:
            args += ["--main_process_port", str(port)]
    return args


def machine_settings(recipe) -> tuple[int, str | None, int | None]:
    """``(machine_rank, main_process_ip, main_process_port)``: the recipe's, else its accelerate config's."""
    ln = recipe.launcher
    acc = read_accelerate_config(ln.config)
    rank = getattr(ln, "machine_rank", None)
    ip = getattr(ln, "main_process_ip", None) or acc.get("main_process_ip")
    port = getattr(ln, "main_process_port", None) or acc.get("main_process_port")
    return (int(acc.get("machine_rank", 0)) if rank is None else int(rank), ip, None if port is None else int(port))


def deepspeed_config_for(recipe, hidden_size: int | None = None) -> dict | None:
    """The recipe's DeepSpeed config with every ``"auto"`` filled from the recipe (None without
    DeepSpeed), for ``accelerate.DeepSpeedPlugin(hf_ds_config=...)``.

    Why not leave the autos to accelerate: it fills ``gradient_clipping`` with 1.0 (not
    ``training.grad_clip``), and the bucket sizes from ``model.config.hidden_size``, which a
    speculator module may not have. ``hidden_size`` defaults to the target's (preset or local
    config.json); the bucket formulas are accelerate's own."""
    if recipe.launcher.deepspeed is None:
        return None
    from .presets import resolve_architecture  # reads files only; kept out of the schema's import path

    tr = recipe.training
    nproc, _ = process_counts(recipe)
    cfg = copy.deepcopy(read_deepspeed_config(recipe.launcher.deepspeed))
    H = hidden_size or resolve_architecture(recipe.target.name).hidden_size
    fills = {
        "train_micro_batch_size_per_gpu": tr.batch_size,
        "gradient_accumulation_steps": tr.grad_accum,
        "train_batch_size": tr.batch_size * tr.grad_accum * nproc,
        "gradient_clipping": float(tr.grad_clip or 0.0),  # 0 = no clipping in DeepSpeed
        "bf16.enabled": tr.precision == "bf16",
        "fp16.enabled": tr.precision == "fp16",
        "zero_optimization.reduce_bucket_size": H * H,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * H * H),
        "zero_optimization.stage3_param_persistence_threshold": 10 * H,
    }
    for dotted, value in fills.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for part in parents:
            node = node.get(part, {})
        if node.get(leaf) == "auto":
            node[leaf] = value

    def autos(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from autos(v, f"{prefix}{k}.")
            elif v == "auto":
                yield prefix + k

    left = list(autos(cfg))
    if left:
        raise ValueError(f"DeepSpeed config {recipe.launcher.deepspeed!r}: no recipe value for 'auto' keys {left}")
    return cfg


PG_TIMEOUT_ENV = "SPECFOUNDRY_PROCESS_GROUP_TIMEOUT_MIN"
DEFAULT_PG_TIMEOUT_MIN = 720


def process_group_kwargs(env=os.environ) -> dict:
    """Process-group settings of a multi-process run: gloo without CUDA (accelerate picks no
    backend for DeepSpeed/DDP then), and a long collective timeout: the main process generates
    the self-distilled data (hours for the 70B recipe) while the other ranks wait at a barrier,
    which the default 10-30 min would abort. ``$SPECFOUNDRY_PROCESS_GROUP_TIMEOUT_MIN`` overrides
    the 12 h default."""
    from datetime import timedelta

    import torch  # here: this module imports no torch at import time

    raw = env.get(PG_TIMEOUT_ENV, str(DEFAULT_PG_TIMEOUT_MIN))
    try:
        minutes = float(raw)
    except ValueError:
        minutes = -1.0
    if not minutes > 0 or minutes != minutes or minutes == float("inf"):
        raise ValueError(f"{PG_TIMEOUT_ENV} must be a positive number of minutes, got {raw!r}")
    out = {"timeout": timedelta(minutes=minutes)}
    if not torch.cuda.is_available():
        out["backend"] = "gloo"
    return out
