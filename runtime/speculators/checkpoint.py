"""The speculator checkpoint format: a directory with ``config.json`` + ``model.safetensors``.

Scope: writing (:func:`save_speculator`, atomic), reading and strictly validating
(:func:`read_config`, :func:`load_speculator`). Serving formats for other engines are export's
business; they start from what this module loads.

``config.json``::

    {
      "format": "specfoundry.speculator",
      "format_version": 1,
      "speculator_type": "eagle3",          # a key of SPECULATOR_REGISTRY
      "architecture": {...},                # checked against the class's ARCHITECTURE_SCHEMA
      "target": {"name": str, "vocab_size": int, "hidden_size": int, "num_layers": int,
                 "fingerprint": str, "feature_layers": [int, ...]},
      "training": {...}                     # optional, free-form metadata
    }

Every key is required unless marked optional; unknown keys, missing keys and wrong types are
one :class:`CheckpointError` naming the file and the key. A checkpoint loads only against the
target it was trained for (vocab size, hidden size, layer count and embedding fingerprint; the
name is informational). Tensors a head shares with the target (the embedding; EAGLE-1's
``lm_head``) are not stored: they are the target's own modules at load.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_dir
from .registry import SPECULATOR_REGISTRY

__all__ = [
    "CONFIG_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "WEIGHTS_NAME",
    "CheckpointError",
    "TargetMismatchError",
    "load_speculator",
    "read_config",
    "save_speculator",
    "tensor_problems",
    "validate_config",
]

FORMAT = "specfoundry.speculator"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_TOP_SCHEMA = {
    "format": str,
    "format_version": int,
    "speculator_type": str,
    "architecture": dict,
    "target": dict,
    "training": dict,
}
_TOP_OPTIONAL = {"training"}
_TARGET_SCHEMA = {
    "name": str,
    "vocab_size": int,
    "hidden_size": int,
    "num_layers": int,
    "fingerprint": str,
    "feature_layers": ("list", int),
}
# what must agree between the checkpoint's target and the given one (name is informational)
_IDENTITY_KEYS = ("vocab_size", "hidden_size", "num_layers", "fingerprint")


class CheckpointError(ValueError):
    """A speculator checkpoint that cannot be used; names the file and, when known, the key."""

    def __init__(self, file, key: str | None, problem: str):
        self.file = str(file)
        self.key = key
        self.problem = problem
        where = f"{self.file}: key {key!r}: " if key else f"{self.file}: "
        super().__init__(where + problem)


class TargetMismatchError(CheckpointError):
    """The checkpoint was trained for a different target model."""


# ------------------------------------------------------------------------------ validation


def _type_ok(value, spec) -> bool:
    if spec is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if spec is float:  # JSON writes 1.0 as 1.0, but a hand-edited 1 is still a number
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(spec, tuple) and spec[0] == "list":
        return isinstance(value, list) and all(_type_ok(v, spec[1]) for v in value)
    return isinstance(value, spec) and not (spec is not bool and isinstance(value, bool))


def _type_name(spec) -> str:
    if isinstance(spec, tuple):
        return f"list of {_type_name(spec[1])}"
    return {int: "int", float: "number", str: "string", bool: "bool", dict: "object"}[spec]


def _json_type(value) -> str:
    return {bool: "bool", int: "int", float: "number", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _check_fields(obj: dict, schema: dict, file, prefix: str = "", optional=frozenset()) -> None:
    for key in obj:
        if key not in schema:
            raise CheckpointError(file, prefix + key, f"unknown key (allowed: {', '.join(sorted(schema))})")
    for key, spec in schema.items():
        if key not in obj:
            if key in optional:
                continue
            raise CheckpointError(file, prefix + key, "missing")
        if not _type_ok(obj[key], spec):
            raise CheckpointError(file, prefix + key,
                                  f"expected {_type_name(spec)}, got {_json_type(obj[key])} ({obj[key]!r:.60})")


def validate_config(cfg, file=CONFIG_NAME, target=None) -> dict:
    """Check a parsed ``config.json`` (and, given ``target``, the architecture's fit to it);
    returns ``cfg`` or raises one :class:`CheckpointError`."""
    if not isinstance(cfg, dict):
        raise CheckpointError(file, None, f"expected a JSON object at the top level, got {_json_type(cfg)}")
    _check_fields(cfg, _TOP_SCHEMA, file, optional=_TOP_OPTIONAL)
    if cfg["format"] != FORMAT:
        raise CheckpointError(file, "format", f"expected {FORMAT!r}, got {cfg['format']!r}")
    if cfg["format_version"] != FORMAT_VERSION:
        raise CheckpointError(file, "format_version",
                              f"this runtime reads version {FORMAT_VERSION}, got {cfg['format_version']}")
    kind = cfg["speculator_type"]
    if kind not in SPECULATOR_REGISTRY:
        raise CheckpointError(file, "speculator_type",
                              f"unknown type {kind!r} (known: {', '.join(sorted(SPECULATOR_REGISTRY))})")
    cls = SPECULATOR_REGISTRY[kind]
    _check_fields(cfg["architecture"], cls.ARCHITECTURE_SCHEMA, file, prefix="architecture.",
                  optional=getattr(cls, "ARCHITECTURE_OPTIONAL", frozenset()))
    _check_fields(cfg["target"], _TARGET_SCHEMA, file, prefix="target.")
    for key, problem in cls.architecture_problems(cfg["architecture"], target):
        raise CheckpointError(file, "architecture." + key, problem)
    training = cfg.get("training") or {}
    if "drafter_options" in training:
        for key, problem in drafter_option_problems(training["drafter_options"]):
            raise CheckpointError(file, "training.drafter_options" + (f".{key}" if key else ""), problem)
    if "runtime_shape" in training:
        for key, problem in runtime_shape_problems(training["runtime_shape"]):
            raise CheckpointError(file, "training.runtime_shape" + (f".{key}" if key else ""), problem)
    if "draft_temperature" in training:
        for key, problem in draft_temperature_problems(training["draft_temperature"]):
            raise CheckpointError(file, "training.draft_temperature" + (f".{key}" if key else ""), problem)
    if list(cfg["target"]["feature_layers"]) != list(cfg["architecture"]["feature_layers"]):
        raise CheckpointError(file, "target.feature_layers",
                              f"{cfg['target']['feature_layers']} != architecture.feature_layers "
                              f"{cfg['architecture']['feature_layers']}")
    return cfg


def tensor_problems(tensors: dict, cls=None, architecture: dict | None = None) -> list[tuple[str, str]]:
    """``(tensor name, problem)`` for every tensor that cannot be used: non-finite floating values,
    and (``cls.tensor_problems``) index tensors out of range or inconsistent."""
    out = []
    for name, t in tensors.items():
        if t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                out.append((name, f"holds {bad} non-finite value(s) (NaN/inf) of {t.numel()}: the weights are "
                                  "corrupt or come from a diverged training run"))
    if cls is not None and hasattr(cls, "tensor_problems"):
        out += cls.tensor_problems(tensors, architecture)
    return out


def drafter_option_problems(options) -> list[tuple[str | None, str]]:
    """Problems of the draft shape a checkpoint records (``training.drafter_options``, the
    default :func:`~specfoundry.runtime.drafters.load_drafter` uses): known keys, types, bounds."""
    from ..adaptive import MAX_DRAFT_DEPTH, MAX_DRAFT_NODES, MAX_DRAFT_TOP_K, check_int

    if not isinstance(options, dict):
        return [(None, f"expected an object, got {_json_type(options)}")]
    bounds = {"depth": (1, MAX_DRAFT_DEPTH), "top_k": (1, MAX_DRAFT_TOP_K), "total_tokens": (2, MAX_DRAFT_NODES)}
    out = []
    for key, value in options.items():
        if key == "tree":
            if value not in ("dynamic", "chain"):
                out.append((key, f"must be 'dynamic' or 'chain', got {value!r:.60}"))
        elif key == "choices":  # a Medusa checkpoint's static tree (rank paths, prefix-closed)
            problem = choices_problem(value, MAX_DRAFT_NODES - 1, MAX_DRAFT_DEPTH)
            if problem:
                out.append((key, problem))
        elif key in bounds:
            try:
                check_int(key, value, *bounds[key])
            except ValueError as exc:
                out.append((key, str(exc)))
        else:
            out.append((key, f"unknown draft option (allowed: tree, choices, {', '.join(bounds)})"))
    return out


def choices_problem(choices, max_paths: int, max_depth: int) -> str | None:
    """What is wrong with a static tree given as Medusa rank paths (None: nothing): a non-empty
    list of distinct, non-empty lists of integer ranks >= 0, at most ``max_paths`` of them, none
    deeper than ``max_depth``, every path's prefix present (prefix-closed)."""
    if not isinstance(choices, list) or not choices:
        return f"expected a non-empty list of rank paths, got {choices!r:.60}"
    if len(choices) > max_paths:
        return f"{len(choices)} paths, more than the {max_paths} draft nodes allowed"
    paths = set()
    for c in choices:
        if not isinstance(c, list) or not c or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c):
            return f"every path must be a non-empty list of integer ranks >= 0, got {c!r:.60}"
        if len(c) > max_depth:
            return f"path {c} is deeper than {max_depth}"
        paths.add(tuple(c))
    if len(paths) != len(choices):
        return "paths must be distinct"
    missing = next((list(p[:-1]) for p in paths if len(p) > 1 and p[:-1] not in paths), None)
    if missing is not None:
        return f"the prefix {missing} of a path is missing (the tree must be prefix-closed)"
    return None


#: the draft-shape keys of ``training.drafter_options`` / ``training.runtime_shape`` (EAGLE drafters' options)
DRAFT_SHAPE_KEYS = ("tree", "depth", "top_k", "total_tokens")


def default_draft_shape(cfg: dict) -> tuple[dict, bool]:
    """``(draft options, adaptive)`` a checkpoint loads with when its caller names no shape: its
    measured runtime shape (``training.runtime_shape``, runtime/tune.py) with its adaptive setting,
    else the shape its tau was measured with (``training.drafter_options``) under the controller."""
    training = cfg.get("training") or {}
    runtime = training.get("runtime_shape")
    saved = runtime or training.get("drafter_options") or {}
    return {k: v for k, v in saved.items() if k in DRAFT_SHAPE_KEYS}, (runtime["adaptive"] if runtime else True)


#: what ``training.runtime_shape`` may hold beside the draft options (see runtime/tune.py): the
#: adaptive setting that goes with the shape, and how it was measured
_RUNTIME_SHAPE_SCHEMA = {"adaptive": bool, "speedups": dict, "prompts": int, "max_new_tokens": int,
                         "prompt_lookup": int, "threads": int, "dtype": str, "device": str, "candidate": str}


def runtime_shape_problems(shape) -> list[tuple[str | None, str]]:
    """Problems of a checkpoint's measured runtime default shape (``training.runtime_shape``,
    written by :func:`set_runtime_shape`): the draft options as in ``drafter_options``, ``adaptive``
    required, the measurement's fields typed, no other key."""
    if not isinstance(shape, dict):
        return [(None, f"expected an object, got {_json_type(shape)}")]
    options = {k: v for k, v in shape.items() if k in DRAFT_SHAPE_KEYS}
    out = drafter_option_problems(options)
    if "adaptive" not in shape:
        out.append(("adaptive", "missing"))
    for key, value in shape.items():
        if key in options:
            continue
        spec = _RUNTIME_SHAPE_SCHEMA.get(key)
        if spec is None:
            out.append((key, f"unknown key (allowed: {', '.join(DRAFT_SHAPE_KEYS + tuple(_RUNTIME_SHAPE_SCHEMA))})"))
        elif not _type_ok(value, spec):
            out.append((key, f"expected {_type_name(spec)}, got {_json_type(value)} ({value!r:.60})"))
        elif key == "speedups" and not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            out.append((key, "expected numbers"))
    return out


#: the largest draft temperature scale a drafter or checkpoint takes (``EagleDrafter(draft_temperature=)``)
MAX_DRAFT_TEMPERATURE = 4.0

#: what ``training.draft_temperature`` holds (see runtime/calibrate.py): the scale drafters load with,
#: and how it was measured
_DRAFT_TEMPERATURE_SCHEMA = {"scale": float, "acceptance": dict, "temperatures": ("list", float), "positions": int,
                             "prompts": int, "max_new_tokens": int}


def draft_temperature_problems(value) -> list[tuple[str | None, str]]:
    """Problems of a checkpoint's measured draft temperature (``training.draft_temperature``, written by
    :func:`set_draft_temperature`): ``scale`` required in (0, MAX_DRAFT_TEMPERATURE], the measurement's
    fields typed, no other key."""
    if not isinstance(value, dict):
        return [(None, f"expected an object, got {_json_type(value)}")]
    out = []
    if "scale" not in value:
        out.append(("scale", "missing"))
    for key, item in value.items():
        spec = _DRAFT_TEMPERATURE_SCHEMA.get(key)
        if spec is None:
            out.append((key, f"unknown key (allowed: {', '.join(_DRAFT_TEMPERATURE_SCHEMA)})"))
        elif not _type_ok(item, spec):
            out.append((key, f"expected {_type_name(spec)}, got {_json_type(item)} ({item!r:.60})"))
        elif key == "scale" and not 0 < item <= MAX_DRAFT_TEMPERATURE:
            out.append((key, f"must be in (0, {MAX_DRAFT_TEMPERATURE}], got {item}"))
        elif key == "acceptance" and not all(_type_ok(v, float) for v in item.values()):
            out.append((key, "expected numbers"))
    return out


def set_draft_temperature(path, measured: dict) -> dict:
    """Store ``measured`` (see :func:`~specfoundry.runtime.calibrate.measure_draft_temperature`) as the
    checkpoint's ``training.draft_temperature``, as :func:`set_runtime_shape` does."""
    return _update_training(path, lambda training: training.update(draft_temperature=measured))


def set_runtime_shape(path, shape: dict) -> dict:
    """Store ``shape`` (see :func:`~specfoundry.runtime.tune.measure_runtime_shape`) as the
    checkpoint's ``training.runtime_shape``, replacing ``config.json`` atomically; returns the new
    config. The weights are untouched."""
    return _update_training(path, lambda training: training.update(runtime_shape=shape))


def set_drafter_options(path, options: dict) -> dict:
    """Merge ``options`` into the checkpoint's ``training.drafter_options`` (the draft shape its
    drafter loads with, e.g. a Medusa tree fitted after training), as :func:`set_runtime_shape`."""
    return _update_training(path, lambda training: training.setdefault("drafter_options", {}).update(options))


def _update_training(path, update) -> dict:
    """``update(cfg["training"])`` in place, then validate and replace ``config.json`` atomically."""
    from ..atomic import atomic_file

    cfg = read_config(path)
    update(cfg.setdefault("training", {}))
    text = json.dumps(cfg, indent=2, allow_nan=False)
    validate_config(json.loads(text), "<config being saved>")
    file = Path(path) / CONFIG_NAME
    with atomic_file(file) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
        shutil.copymode(file, tmp)  # the temporary file is private (0600); keep what the config had
    return cfg


def read_config(path) -> dict:
    """Read and validate ``<path>/config.json`` (no target checks)."""
    file = Path(path) / CONFIG_NAME
    if not Path(path).is_dir():
        raise CheckpointError(path, None, "not a speculator checkpoint directory (expected config.json + model.safetensors)")
    if not file.is_file():
        raise CheckpointError(file, None, "missing: not a speculator checkpoint directory")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(file, None, f"not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(file, None, f"not UTF-8 text: {exc}") from None
    return validate_config(cfg, file)


def _describe(identity: dict) -> str:
    return (f"{identity.get('name')!r} (vocab_size={identity.get('vocab_size')}, hidden_size={identity.get('hidden_size')}, "
            f"num_layers={identity.get('num_layers')}, fingerprint={identity.get('fingerprint')})")


def _check_target(cfg: dict, target, file) -> None:
    saved, given = cfg["target"], target.identity()
    differ = [k for k in _IDENTITY_KEYS if saved[k] != given[k]]
    if differ:
        raise TargetMismatchError(
            file, "target." + differ[0],
            f"this {cfg['speculator_type']} speculator was trained for target {_describe(saved)} but the given "
            f"target is {_describe(given)}; they differ in {', '.join(differ)}",
        )


# ------------------------------------------------------------------------------ save / load


def save_speculator(module: nn.Module, path, target, training: dict | None = None) -> Path:
    """Write ``module`` as a checkpoint directory at ``path`` (replacing an existing checkpoint).

    Atomic for readers: everything is written to a temporary sibling directory and renamed into
    place; an existing checkpoint is moved aside first and removed after. Returns the path.
    """
    kind = getattr(module, "type", None)
    if SPECULATOR_REGISTRY.get(kind) is not type(module):
        raise ValueError(f"{type(module).__name__} is not a registered speculator class "
                         f"({sorted(SPECULATOR_REGISTRY)})")
    ident = target.identity()
    if module.target_identity is not None and any(module.target_identity[k] != ident[k] for k in _IDENTITY_KEYS):
        raise ValueError(f"this {kind} head was built for target {_describe(module.target_identity)}, "
                         f"not {_describe(ident)}")
    cfg = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "speculator_type": kind,
        "architecture": module.architecture,
        "target": {**ident, "feature_layers": [int(i) for i in module.feature_layers]},
    }
    if training is not None:
        cfg["training"] = training
    try:
        text = json.dumps(cfg, indent=2, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint config is not JSON-serialisable: {exc}") from None
    # the same checks a reader will run, so a saved checkpoint always loads
    validate_config(json.loads(text), "<config being saved>", target)

    from safetensors.torch import save_file

    # clone: safetensors refuses aliased/non-contiguous storage and must not see live parameters
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in module.state_dict().items()}
    for name, problem in tensor_problems(tensors, type(module), module.architecture):
        raise ValueError(f"refusing to save this {kind} speculator: tensor {name!r} {problem}")

    path = Path(path)
    with atomic_dir(path, lambda p: (p / CONFIG_NAME).exists(), "a speculator checkpoint") as tmp:
        with open(tmp / CONFIG_NAME, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "speculator_type": kind})
    return path


def load_speculator(path, target, device=None, dtype=None) -> nn.Module:
    """Load the checkpoint at ``path`` for ``target`` (refused if trained for another target).

    ``device``/``dtype`` default to the target's. The returned module is in eval mode.
    """
    path = Path(path)
    cfg = read_config(path)
    file = path / CONFIG_NAME
    _check_target(cfg, target, file)
    validate_config(cfg, file, target)  # the architecture against this target's shapes
    cls = SPECULATOR_REGISTRY[cfg["speculator_type"]]

    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(weights, None, "missing")
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    from .eagle import seeded_init

    # shapes first, from the file's header and a module built without memory: a config.json that
    # inflates the architecture (intermediate_size = 10**9) is a clear error, not an allocation
    try:
        with safe_open(str(weights), framework="pt") as f:
            header = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(weights, None, f"unreadable safetensors file: {exc}") from None
    try:
        with seeded_init(0), torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in cls.build(cfg["architecture"], target).state_dict().items()}
    except Exception:  # noqa: BLE001 - a class that cannot build on "meta": checked after the real build
        shapes = None
    if shapes is not None:
        for name, shape in shapes.items():
            if name in header and header[name] != shape:
                raise CheckpointError(weights, name, f"shape {header[name]} != expected {shape}")

    try:
        tensors = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(weights, None, f"unreadable safetensors file: {exc}") from None

    with seeded_init(0):  # the weights are overwritten; keep the caller's RNG untouched
        module = cls.build(cfg["architecture"], target)
    expected = module.state_dict()
    for name in tensors:
        if name not in expected:
            raise CheckpointError(weights, name, f"unexpected tensor for a {cls.type} head")
    for name, ref in expected.items():
        if name not in tensors:
            raise CheckpointError(weights, name, "missing tensor")
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(weights, name, f"shape {tuple(tensors[name].shape)} != expected {tuple(ref.shape)}")
        if tensors[name].is_floating_point() != ref.is_floating_point():
            raise CheckpointError(weights, name, f"dtype {tensors[name].dtype} does not fit {ref.dtype}")
    # integrity: finite weights, index tensors in range (found here, not as an IndexError mid-generation)
    for name, problem in tensor_problems(tensors, cls, cfg["architecture"]):
        raise CheckpointError(weights, name, problem)
    dtype = dtype or target.dtype
    # cast floating tensors first so a bf16 checkpoint loaded as fp32 (or back) is one copy
    module = module.to(dtype)
    module.load_state_dict(tensors, strict=True)
    # the draft options it was evaluated with (e.g. a Medusa checkpoint's fitted tree): drafters
    # and exporters take them as their defaults
    module.drafter_options = dict((cfg.get("training") or {}).get("drafter_options") or {})
    return module.to(device or target.device).eval()
