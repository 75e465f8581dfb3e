"""Preflight: what a recipe needs from this machine, checked before anything is launched.

``specfoundry train <recipe>`` runs :func:`preflight` after the recipe validates and before it
spawns a process; ``--dry-run`` prints the same checks under the plan. Each check is one
:class:`Check` (name, status ``ok``/``fail``/``warn``/``skip``, one line). A failed check stops
the run with exit code 2 and nothing spawned, instead of N launched processes dying with N
tracebacks.

The checks:

- **devices**: the recipe's device kind and count on this machine: ``cuda`` recipes need
  ``num_processes / num_machines`` CUDA devices here (8 for ``eagle-llama3-70b``), CPU recipes
  need nothing; ``mps`` needs the MPS backend.
- **memory**: the plan's per-device estimate (:mod:`~specfoundry.train.plan_memory`) against the
  free memory of each device this machine will use (CUDA: ``torch.cuda.mem_get_info``; CPU: the
  host's ``MemAvailable`` for all local processes together).
- **disk**: offline hidden states: the feature shards' estimated size (and the states generation keeps)
  against the free space where ``data.cache_dir`` lives.
- **target**: built-in, local directory, or Hub id. A Hub id is looked up in the local HF cache
  only (``HF_HOME``/``HF_HUB_CACHE``; the dry run never downloads). For a real run whose other
  checks all pass, a Hub id missing from the cache is fetched here, once, in the launching process
  (``allow_download=True``), unless ``HF_HUB_OFFLINE=1``; any failure is the runtime's
  :class:`~specfoundry.runtime.models.HubError` line. Medusa-2 / draft ``init_from`` drafts the same.
- **data**: ``file`` prompt sources and topic files exist; ``hub`` prompt sources are in the HF
  datasets cache when ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set (else ``datasets`` fetches
  them at run time). Evaluation prompt files that are missing are a warning (the run skips them).
- **launcher**: accelerate (and DeepSpeed when configured) importable; the DeepSpeed JSON's
  numeric batch sizes agree with the recipe and the process count; multi-node settings complete
  (``main_process_ip``, ``machine_rank < num_machines``).

Nothing here downloads unless ``allow_download`` is set, and nothing spawns a process.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Check", "preflight", "format_checks", "failures", "PreflightError"]

GB = 1e9


class PreflightError(RuntimeError):
    """Raised by :func:`require` with the failed checks' lines."""


@dataclass
class Check:
    name: str
    status: str  # ok | fail | warn | skip
    detail: str

    def line(self) -> str:
        return f"{self.name}: {self.detail}"


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]


def format_checks(checks: list[Check]) -> str:
    """The checks as the dry run prints them (one line each)."""
    tag = {"ok": "ok  ", "fail": "FAIL", "warn": "warn", "skip": "skip"}
    return "\n".join(["preflight (this machine):"] + [f"  {tag[c.status]} {c.name:<9} {c.detail}" for c in checks])


# --------------------------------------------------------------------------------------------
# devices and memory
# --------------------------------------------------------------------------------------------

def _device_kind(recipe) -> str:
    from .launcher import read_accelerate_config

    acc = read_accelerate_config(recipe.launcher.config)
    dev = recipe.target.device
    if dev == "cpu" or acc.get("use_cpu"):
        return "cpu"
    if dev == "mps":
        return "mps"
    return "cuda"


def _local_processes(recipe) -> int:
    n, m = int(recipe.launcher.num_processes or 1), int(recipe.launcher.num_machines or 1)
    return max(1, n // max(1, m))


def cuda_devices() -> tuple[int, list[tuple[float, float]] | None, str]:
    """(count, [(free, total) bytes per device] or None, how it was found). Imports torch."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch is one line too
        return 0, None, f"torch does not import ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return 0, None, f"torch {torch.__version__} sees no CUDA device" + (
            " (a CPU-only build)" if torch.version.cuda is None else "")
    n = torch.cuda.device_count()
    mem = []
    try:
        for i in range(n):
            mem.append(tuple(float(x) for x in torch.cuda.mem_get_info(i)))
    except Exception:  # noqa: BLE001 - memory unknown is a skip, not a failure
        mem = None
    return n, mem, "torch.cuda"


def host_memory_available() -> float | None:
    from specfoundry.runtime.native import available_memory

    avail = available_memory()
    if avail is not None:
        return float(avail)
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def memory_needed(plan) -> tuple[float | None, str]:
    """Bytes per device the run will need, and a note: the plan's estimate. For ``zero3``
    placement that is the training phase with the target partitioned (train/zero3_target.py:
    target / N plus whole copies of its LM head and embedding, and the gathered-layer working
    set); the main process's phases with the whole target (data generation, saving, the final
    evaluation) spread it over the machine's GPUs and are noted, not added."""
    if plan is None:
        return None, ""
    if plan.placement == "zero3" and plan.world_size > 1:
        return plan.memory.total, (f" (target partitioned by ZeRO-3: {plan.memory.target_weights / GB:.1f} GB of "
                                   f"its {plan.target_weight_bytes / GB:.1f} GB per process)")
    return plan.memory.total, ""


def _device_checks(recipe, plan, cuda_probe) -> list[Check]:
    kind, local = _device_kind(recipe), _local_processes(recipe)
    out = []
    need, note = memory_needed(plan)
    machines = int(recipe.launcher.num_machines or 1)
    per = f"{local} process(es) on this machine" + (f" ({machines} machines)" if machines > 1 else "")
    if kind == "cpu":
        out.append(Check("devices", "ok", f"cpu: {per}"))
        avail = host_memory_available()
        if need is None:
            out.append(Check("memory", "skip", "no estimate (the target's architecture is unknown here)"))
        elif avail is None:
            out.append(Check("memory", "skip", f"host memory unknown; the plan needs ~{need / GB:.1f} GB per process"))
        elif need * local > avail:
            out.append(Check("memory", "fail", f"the plan needs ~{need / GB:.1f} GB of host RAM per process x {local} = "
                                               f"{need * local / GB:.1f} GB, {avail / GB:.1f} GB available{note}"))
        else:
            out.append(Check("memory", "ok", f"~{need * local / GB:.2f} GB of host RAM for {local} process(es), "
                                             f"{avail / GB:.1f} GB available"))
        return out
    if kind == "mps":
        try:
            import torch

            ok = bool(torch.backends.mps.is_available())
        except Exception:  # noqa: BLE001
            ok = False
        out.append(Check("devices", "ok" if ok else "fail",
                         "mps available" if ok else "the recipe runs on mps (Apple GPU) and this machine has none"))
        out.append(Check("memory", "skip", "free memory is not measurable on mps"))
        return out
    n, mem, how = cuda_probe()
    if n < local:
        have = "none" if n == 0 else f"{n}"
        why = f"; {how}" if n == 0 else ""
        out.append(Check("devices", "fail", f"recipe {recipe.name} needs {local} CUDA GPU(s) on this machine "
                                            f"({recipe.launcher.num_processes} processes over {machines} machine(s)), "
                                            f"found {have}{why}; on a CPU machine try `specfoundry train {recipe.name} "
                                            "--smoke` (the same code path at toy scale)"))
        out.append(Check("memory", "skip", "no CUDA devices to measure"))
        return out
    out.append(Check("devices", "ok", f"{n} CUDA device(s) for {per}"))
    if need is None:
        out.append(Check("memory", "skip", "no estimate (the target's architecture is unknown here)"))
    elif mem is None:
        out.append(Check("memory", "skip", f"free memory unknown; the plan needs ~{need / GB:.1f} GB per device"))
    else:
        short = [(i, f) for i, (f, _t) in enumerate(mem[:local]) if f < need]
        if short:
            i, f = min(short, key=lambda x: x[1])
            out.append(Check("memory", "fail", f"the run needs ~{need / GB:.1f} GB per device{note}; {len(short)} of "
                                               f"{local} device(s) have less free (cuda:{i}: {f / GB:.1f} GB)"
                                               + ("" if note else "; lower training.batch_size / data.max_seq_len or "
                                                  "use a higher ZeRO stage")))
        else:
            least = min(f for f, _ in mem[:local])
            out.append(Check("memory", "ok", f"~{need / GB:.1f} GB per device needed{note}, at least {least / GB:.1f} "
                                             "GB free"))
        if plan is not None and plan.placement == "zero3" and plan.world_size > 1:
            out.append(_main_process_check(plan, mem))
    return out


def _main_process_check(plan, mem) -> Check:
    """zero3 placement: the main process alone holds the whole target for data generation, saving
    and the final evaluation (train/zero3_target.py), spread over all of this machine's GPUs
    (device_map) when it has several; a rough check of the weights against their free memory."""
    n = len(mem)
    per = plan.target_weight_bytes / n + plan.memory.overhead
    least = min(f for f, _ in mem)
    where = f"over this machine's {n} GPUs" if n > 1 else "on its one GPU"
    text = (f"the main process holds the whole {plan.target_weight_bytes / GB:.1f} GB target {where} for data "
            f"generation and the final evaluation: ~{per / GB:.1f} GB per GPU, at least {least / GB:.1f} GB free")
    return Check("main-process memory", "ok" if per <= least else "fail", text)


# --------------------------------------------------------------------------------------------
# disk
# --------------------------------------------------------------------------------------------

def _existing_parent(p: Path) -> Path:
    p = p.expanduser().absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def _disk_check(recipe, plan) -> Check:
    d = recipe.data
    if d.hidden_states != "offline":
        return Check("disk", "ok", "online hidden states: no feature shards on disk")
    if plan is None or plan.total_tokens is None:
        return Check("disk", "skip", "offline features: size unknown (token count or architecture not known)")
    A = plan.target
    width = (len(recipe.target.feature_layers or [A.num_layers]) + 1) * A.hidden_size
    nbytes = {"fp32": 4, "bf16": 2, "fp16": 2}[recipe.target.dtype]
    need = plan.total_tokens * width * nbytes
    # a batched capture on the engine reads the states self-distillation kept (train/genstates.py):
    # those files stay beside the store (a rerun on more data reuses them), as much again. Counted for
    # any batched capture: preflight loads no model, so it cannot tell an engine target from a HF one
    kept = d.capture_batch_size > 1 and (d.responses.dtype or recipe.target.dtype) == recipe.target.dtype
    need *= 2 if kept else 1
    where = _existing_parent(Path(d.cache_dir))
    free = shutil.disk_usage(where).free
    text = (f"offline features ~{need / GB:.2f} GB in {d.cache_dir}" + (" (with the states generation keeps)" if kept else "")
            + f", {free / GB:.1f} GB free on {where}")
    return Check("disk", "fail" if need > free else "ok", text if need <= free else "not enough disk: " + text)


# --------------------------------------------------------------------------------------------
# target, drafts and data
# --------------------------------------------------------------------------------------------

def _hub_cache() -> Path:
    # runtime.models.hub_cache, restated so the dry run imports neither torch nor huggingface_hub
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def _offline(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def _is_hub_id(name: str) -> bool:
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not name.startswith((".", "/"))


def hub_cached_snapshot(repo_id: str, revision: str | None = None, kind: str = "models") -> Path | None:
    """The cached snapshot directory of a Hub repo (``kind`` models/datasets), or None. Reads the
    cache layout only (``<cache>/<kind>--org--name/{refs,snapshots}``); never touches the network."""
    repo = _hub_cache() / f"{kind}--{repo_id.replace('/', '--')}"
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    rev = revision or "main"
    ref = repo / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = snaps / commit
    if snap.is_dir():
        return snap
    if revision is None:  # no refs/main (e.g. a copied cache): any snapshot
        found = sorted(p for p in snaps.iterdir() if p.is_dir())
        return found[-1] if found else None
    return None


def _model_check(label: str, name: str, revision: str | None, allow_download: bool) -> Check:
    """A target or a draft: built-in, local directory, or Hub id."""
    at = f"{name}@{revision}" if revision else name
    p = Path(name).expanduser()
    if name in _builtin_names():
        return Check(label, "ok", f"{name}: built-in")
    if p.is_dir():
        if (p / "config.json").is_file() or (p / "adapter_config.json").is_file():
            return Check(label, "ok", f"{name}: local directory")
        return Check(label, "fail", f"{name}: a directory without config.json (not a Hugging Face model directory)")
    if not _is_hub_id(name):
        return Check(label, "fail", f"{name!r} is neither a built-in target ({', '.join(_builtin_names())}), a local "
                                    "Hugging Face model directory, nor a Hub id like 'org/name'")
    snap = hub_cached_snapshot(name, revision)
    if snap is not None and (snap / "config.json").is_file():
        if not any(snap.glob("*.safetensors")):
            return Check(label, "fail", f"{at} in the HF cache has no safetensors weights (pickled .bin weights are "
                                        "never loaded)")
        return Check(label, "ok", f"{at}: in the Hugging Face cache ({snap})")
    offline = _offline("HF_HUB_OFFLINE")
    if offline:
        return Check(label, "fail", f"{at} is not in the Hugging Face cache ({_hub_cache()}) and HF_HUB_OFFLINE=1 is "
                                    f"set: download it where there is network (`hf download {name}`) and copy the "
                                    "cache, or point HF_HOME at it")
    if not allow_download:
        return Check(label, "warn", f"{at} is not in the Hugging Face cache ({_hub_cache()}); a real run downloads it "
                                    "first (gated models need HF_TOKEN or `hf auth login`)")
    try:
        from specfoundry.runtime.models import HubError, hub_snapshot
    except Exception as e:  # noqa: BLE001
        return Check(label, "fail", f"{at}: cannot import the Hub client ({type(e).__name__}: {e})")
    try:
        path = hub_snapshot(name, revision)
    except HubError as e:
        return Check(label, "fail", str(e))
    return Check(label, "ok", f"{at}: downloaded to the Hugging Face cache ({path})")


def _builtin_names() -> list[str]:
    return ["smollm2-135m"]  # runtime.models._BUILTIN (restated: no torch import here)


def _data_checks(recipe) -> list[Check]:
    from .recipe_checks import BUILTIN_HELDOUT

    out, problems, described = [], [], []
    datasets_offline = _offline("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    for i, src in enumerate(recipe.data.prompts):
        key = f"data.prompts[{i}]"
        if src.source == "file":
            if not Path(src.path).expanduser().is_file():
                problems.append(f"{key}: prompt file {src.path} not found (relative to {Path.cwd()})")
            else:
                described.append(f"file {src.path}")
        elif src.source == "hub":
            cached = hub_cached_snapshot(src.name, kind="datasets") is not None or _datasets_cache_has(src.name)
            if datasets_offline and not cached:
                problems.append(f"{key}: dataset {src.name} is not in the Hugging Face cache and the Hub is off "
                                "(HF_HUB_OFFLINE/HF_DATASETS_OFFLINE): download it where there is network first")
            else:
                described.append(f"hub {src.name}" + (" (cached)" if cached else " (fetched at run time)"))
        elif src.source == "magpie":
            if src.topics != "builtin" and not Path(src.topics).expanduser().is_file():
                problems.append(f"{key}.topics: topic file {src.topics} not found")
            else:
                described.append(f"magpie x{src.count}")
    if problems:
        out += [Check("data", "fail", p) for p in problems]
    else:
        out.append(Check("data", "ok", "; ".join(described) or "no prompt sources"))
    missing = [s for s in recipe.evaluation.prompt_sets if s != BUILTIN_HELDOUT and not Path(s).expanduser().exists()]
    if missing:
        out.append(Check("eval", "warn", f"evaluation set(s) not found, skipped by the run: {', '.join(missing)}"))
    return out


def _datasets_cache_has(name: str) -> bool:
    root = Path(os.environ.get("HF_DATASETS_CACHE") or (Path(os.environ.get("HF_HOME") or Path.home() / ".cache" /
                                                              "huggingface") / "datasets")).expanduser()
    return root.is_dir() and any(root.glob(name.replace("/", "___") + "*"))


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------

def _launcher_checks(recipe) -> list[Check]:
    from .launcher import deepspeed_config_for, read_accelerate_config

    ln, out, problems = recipe.launcher, [], []
    nproc, nmach = int(ln.num_processes or 1), int(ln.num_machines or 1)
    acc = read_accelerate_config(ln.config)
    multi = nproc > 1 or ln.deepspeed is not None
    if multi and importlib.util.find_spec("accelerate") is None:
        problems.append("accelerate is not installed (pip install 'specfoundry[train]')")
    if ln.deepspeed is not None:
        if importlib.util.find_spec("deepspeed") is None:
            problems.append(f"launcher.deepspeed {ln.deepspeed!r} needs DeepSpeed, which is not installed")
        try:
            ds = deepspeed_config_for(recipe, hidden_size=_hidden_size_or_1(recipe))
        except (ValueError, OSError) as e:
            problems.append(f"launcher.deepspeed: {e}")
            ds = None
        if ds is not None:
            tr = recipe.training
            want = {"train_micro_batch_size_per_gpu": tr.batch_size, "gradient_accumulation_steps": tr.grad_accum,
                    "train_batch_size": tr.batch_size * tr.grad_accum * nproc}
            for k, v in want.items():
                if k in ds and ds[k] != v:
                    problems.append(f"launcher.deepspeed: {k} is {ds[k]} in {ln.deepspeed!r}, but the recipe with "
                                    f"{nproc} process(es) makes it {v} (set it to \"auto\")")
    if acc.get("distributed_type") == "MULTI_CPU" and nproc > 1 and not acc.get("mpirun_config"):
        # accelerate's simple launcher starts ONE process for a MULTI_CPU config unless mpirun runs it
        problems.append(f"accelerate config {ln.config!r} (MULTI_CPU) would start 1 process, not {nproc}: accelerate "
                        "launches CPU data parallelism through mpirun only; use zero-cpu-2proc with a ZeRO config "
                        "(torchrun, gloo) for several CPU processes")
    if nmach > 1:
        rank = getattr(ln, "machine_rank", None)
        rank = int(acc.get("machine_rank", 0)) if rank is None else int(rank)
        ip = getattr(ln, "main_process_ip", None) or acc.get("main_process_ip")
        if not ip:
            problems.append(f"{nmach} machines need launcher.main_process_ip (the address of machine_rank 0)")
        if not 0 <= rank < nmach:
            problems.append(f"launcher.machine_rank {rank} is not in 0..{nmach - 1}")
    if problems:
        return [Check("launcher", "fail", p) for p in problems]
    what = ln.config + (f" + DeepSpeed {ln.deepspeed}" if ln.deepspeed else "")
    return [Check("launcher", "ok", f"{what}: {nproc} process(es) over {nmach} machine(s)")]


def _hidden_size_or_1(recipe) -> int:
    from .presets import PresetError, find_architecture

    try:
        arch = find_architecture(recipe.target.name)
    except PresetError:
        arch = None
    return arch.hidden_size if arch is not None else 1


# --------------------------------------------------------------------------------------------
# all together
# --------------------------------------------------------------------------------------------

def _plan_or_none(recipe):
    from .plan import make_plan
    from .recipe_errors import RecipeError

    try:
        return make_plan(recipe)
    except RecipeError:
        return None
    except Exception:  # noqa: BLE001 - an estimate that cannot be made is a skipped check, not a crash
        return None


def preflight(recipe, *, plan=None, allow_download: bool = False, cuda_probe=None) -> list[Check]:
    """Every check for ``recipe`` (resolved or not) on this machine. ``allow_download``: a Hub
    target missing from the cache is fetched when every other check passed (a real run); the dry
    run leaves it False. ``cuda_probe`` replaces :func:`cuda_devices` (tests)."""
    from .recipe import resolve

    r = resolve(recipe)
    plan = plan if plan is not None else _plan_or_none(r)
    checks = _device_checks(r, plan, cuda_probe or cuda_devices)
    checks.append(_disk_check(r, plan))
    checks += _data_checks(r)
    checks += _launcher_checks(r)
    revision = getattr(r.target, "revision", None)
    model_checks = [("target", r.target.name, revision)]
    init_from = getattr(r.speculator, "init_from", None)
    if init_from:
        model_checks.append(("draft", init_from, None))
    others_ok = not failures(checks)
    for label, name, rev in model_checks:
        checks.append(_model_check(label, name, rev, allow_download and others_ok))
    return checks


def require(recipe, **kwargs) -> list[Check]:
    """:func:`preflight`, raising :class:`PreflightError` (its lines) when a check fails."""
    checks = preflight(recipe, **kwargs)
    bad = failures(checks)
    if bad:
        raise PreflightError("\n".join(c.line() for c in bad))
    return checks


def report_failures(checks: list[Check], recipe_name: str, stream=None) -> None:
    """One line per failed check, as ``specfoundry train`` prints them."""
    stream = stream or sys.stderr
    for c in failures(checks):
        print(f"specfoundry train {recipe_name}: preflight: {c.line()}", file=stream)
