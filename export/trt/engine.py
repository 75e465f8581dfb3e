"""TensorRT engines from the plugin ONNX graphs: ``build_engines(onnx_dir, out_dir, profiles=...)``.

Scope: parse ``<onnx_dir>/target.plugin.onnx`` and ``<onnx_dir>/speculator.plugin.onnx`` (written by
``specfoundry.export.onnx``; their ``specfoundry::TreeAttention`` nodes map to the QDP in plugin.py)
into strongly typed networks (the ONNX dtypes are the engine dtypes), add optimisation profiles over
batch, tree tokens and past length, build one engine per graph, and write them with
``engines.json`` (files, TensorRT version, GPU, profiles, I/O).

Where TensorRT or a GPU is missing, ``build_engines`` raises ``EngineUnavailable`` with one
sentence saying what is missing and what was still written (the ONNX graphs, the PTX kernels);
``specfoundry export --engine trt`` turns that into a non-zero exit. Everything before the TensorRT
calls (finding the graphs, resolving symbolic dims to profile shapes) is plain Python and tested
without TensorRT.

Dynamic input dims are resolved by their ONNX ``dim_param`` names, evaluated as arithmetic over the
profile symbols ``batch``, ``tree_tokens`` and ``past`` (aliases below; ``dim_symbols`` maps other
names, e.g. ``{"s0": "batch", "s1": "past + tree_tokens"}``).
"""

from __future__ import annotations

import ast
import ctypes
import json
import math
import operator
import time
from pathlib import Path

MODELS = {"target": "target.plugin.onnx", "speculator": "speculator.plugin.onnx",
          # EAGLE heads only: the feature fusion (features [B,T,F,H] -> hidden), built when exported
          "speculator_fuse": "speculator.plugin.fuse.onnx"}
OPTIONAL_MODELS = ("speculator_fuse",)

# (min, opt, max) per profile axis. past may be 0 (a first verification right after an empty cache).
DEFAULT_PROFILES = {"batch": (1, 1, 4), "tree_tokens": (1, 16, 64), "past": (0, 512, 2048)}
AXES = ("batch", "tree_tokens", "past")

# names the ONNX export may give the same quantities
ALIASES = {
    "batch": "batch", "batch_size": "batch", "B": "batch",
    "tree_tokens": "tree_tokens", "tree": "tree_tokens", "new_tokens": "tree_tokens", "num_tokens": "tree_tokens",
    "T": "tree_tokens", "tokens": "tree_tokens",
    "past": "past", "past_len": "past", "past_length": "past", "P": "past",
    "total": "past + tree_tokens", "kv_len": "past + tree_tokens", "S": "past + tree_tokens",
    "total_len": "past + tree_tokens", "mask_words": "(tree_tokens + 31) // 32", "W": "(tree_tokens + 31) // 32",
}


class EngineUnavailable(RuntimeError):
    """TensorRT engines cannot be built here (TensorRT or a GPU is missing); the message is one sentence."""


# ---------------------------------------------------------------------------------------------
# Availability

def cuda_device_count() -> int:
    """GPUs visible to the CUDA driver (0 without a driver); independent of torch's build."""
    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


def _written_sentence(onnx_dir: Path, out_dir: Path) -> str:
    onnx_files = sorted(p.name for p in onnx_dir.glob("*.onnx")) if onnx_dir.is_dir() else []
    ptx_files = sorted(p.name for p in out_dir.glob("*.ptx")) if out_dir.is_dir() else []
    parts = []
    if onnx_files:
        parts.append(f"the ONNX graphs ({', '.join(onnx_files)}) in {onnx_dir}")
    if ptx_files:
        parts.append(f"{len(ptx_files)} PTX kernel(s) in {out_dir}")
    return " and ".join(parts) if parts else "no ONNX graphs or PTX kernels (export them with --formats onnx,ptx)"


def check_available(onnx_dir: Path, out_dir: Path):
    """Import TensorRT and make sure a GPU is visible, else raise EngineUnavailable (one sentence)."""
    written = _written_sentence(Path(onnx_dir), Path(out_dir))
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or OSError for a missing libnvinfer / libnvonnxparser
        raise EngineUnavailable(
            f"TensorRT engines were not built because the tensorrt Python package is not importable "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
            f"still written: {written}.") from None
    if cuda_device_count() == 0:
        raise EngineUnavailable(
            f"TensorRT engines were not built because no CUDA GPU is visible (TensorRT {trt.__version__} needs "
            f"one to build); still written: {written}.")
    return trt


# ---------------------------------------------------------------------------------------------
# Symbolic dims -> profile shapes (pure Python)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.truediv, ast.Mod: operator.mod}
_FUNCS = {"max": max, "min": min, "Max": max, "Min": min, "floor": math.floor, "ceil": math.ceil,
          "CeilToInt": math.ceil, "FloorToInt": math.floor, "FloorDiv": operator.floordiv,
          "CeilDiv": lambda a, b: -(-a // b)}


def eval_dim(expr: str, env: dict, dim_symbols: dict | None = None, _depth: int = 0) -> int:
    """Evaluate a dim_param like ``"past + tree_tokens"`` or ``"((s1 + 31)//32)"`` over ``env``
    (axis name -> int). Unknown names go through ``dim_symbols`` then ALIASES; else ValueError."""
    if _depth > 8:
        raise ValueError(f"dim symbol {expr!r} expands recursively")
    dim_symbols = dim_symbols or {}

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            name = node.id
            if name in env:
                return env[name]
            for table in (dim_symbols, ALIASES):
                if name in table:
                    return eval_dim(str(table[name]), env, dim_symbols, _depth + 1)
            raise ValueError(f"ONNX dim {name!r} is not a profile symbol; name it batch / tree_tokens / past "
                             f"(or an expression of them) or pass dim_symbols={{{name!r}: ...}}")
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"cannot evaluate ONNX dim expression {expr!r}")

    value = ev(ast.parse(str(expr).strip(), mode="eval"))
    if value != int(value):
        raise ValueError(f"ONNX dim {expr!r} evaluates to non-integer {value}")
    return int(value)


def _normalise_profiles(profiles) -> list[dict]:
    if profiles is None:
        profiles = DEFAULT_PROFILES
    if isinstance(profiles, dict):
        profiles = [profiles]
    out = []
    for prof in profiles:
        full = {**DEFAULT_PROFILES, **prof}
        unknown = set(full) - set(AXES)
        if unknown:
            raise ValueError(f"unknown profile axes {sorted(unknown)}; use {AXES}")
        for axis, triple in full.items():
            lo, opt, hi = (int(x) for x in triple)
            if not (0 <= lo <= opt <= hi):
                raise ValueError(f"profile {axis}={triple} must satisfy 0 <= min <= opt <= max")
            if axis != "past" and lo < 1:
                raise ValueError(f"profile {axis} must be at least 1")
        out.append({a: tuple(int(x) for x in full[a]) for a in AXES})
    return out


def onnx_input_dims(onnx_path: Path) -> dict[str, list]:
    """Graph inputs (not initializers) -> dims, each an int or a dim_param string (weights not loaded)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    dims = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        shape = inp.type.tensor_type.shape
        row = []
        for d in shape.dim:
            if d.HasField("dim_value"):
                row.append(int(d.dim_value))
            elif d.HasField("dim_param"):
                row.append(d.dim_param)
            else:
                raise ValueError(f"{onnx_path.name}: input {inp.name} has an unnamed dynamic dim; "
                                 f"export it with a named dim (batch / tree_tokens / past)")
        dims[inp.name] = row
    return dims


# where the graphs of specfoundry.export.onnx keep each axis (inputs named as in export/onnx/graphs.py);
# the dynamo exporter names Dim.DYNAMIC dims s0, s1, ..., so the axes are recovered from these roles
INPUT_ROLES = {
    "input_ids": {0: "batch", 1: "tree_tokens"},
    "position_ids": {0: "batch", 1: "tree_tokens"},
    "hidden": {0: "batch", 1: "tree_tokens"},
    "features": {0: "batch", 1: "tree_tokens"},
    "tree_mask": {0: "batch", 1: "tree_tokens", 2: "(tree_tokens + 31) // 32"},
    "past_key_values.*": {0: "batch", 2: "past"},
}


def auto_dim_symbols(input_dims: dict[str, list]) -> dict[str, str]:
    """Bind the graphs' plain symbolic dim names (e.g. 's3') to profile axes from INPUT_ROLES."""
    import fnmatch

    bound: dict[str, str] = {}
    for name, dims in input_dims.items():
        for pattern, roles in INPUT_ROLES.items():
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            for idx, axis in roles.items():
                if idx >= len(dims) or not isinstance(dims[idx], str) or not dims[idx].isidentifier():
                    continue
                sym = dims[idx]
                if sym in AXES or sym == axis:
                    continue
                if bound.get(sym, axis) != axis:
                    raise ValueError(f"ONNX dim {sym!r} is both {bound[sym]!r} and {axis!r} (input {name}); the "
                                     f"export tied two axes together; pass dim_symbols to say which it is")
                bound[sym] = axis
    return bound


def profile_shapes(input_dims: dict[str, list], profile: dict, dim_symbols: dict | None = None) -> dict:
    """input name -> (min_shape, opt_shape, max_shape) for one profile (axis -> (min, opt, max)).
    Symbols are bound by ``auto_dim_symbols`` first, then by ``dim_symbols`` (which wins)."""
    dim_symbols = {**auto_dim_symbols(input_dims), **(dim_symbols or {})}
    shapes = {}
    for name, dims in input_dims.items():
        triple = []
        for k in range(3):
            env = {axis: profile[axis][k] for axis in AXES}
            triple.append(tuple(d if isinstance(d, int) else eval_dim(d, env, dim_symbols) for d in dims))
        shapes[name] = tuple(triple)
    return shapes


def with_aot_attribute(onnx_path: Path, aot: bool = True) -> bytes:
    """The graph's bytes with int attribute ``aot`` set on every TreeAttention node (the ONNX parser
    then uses the plugin's AOT implementation). External weights stay external."""
    import onnx
    from onnx import helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "TreeAttention":
            kept = [a for a in node.attribute if a.name != "aot"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("aot", int(aot))])
    return model.SerializeToString()


# ---------------------------------------------------------------------------------------------
# Building

def _build_one(trt, onnx_path: Path, engine_path: Path, profiles: list[dict], dim_symbols, aot: bool,
               workspace_gib: float) -> dict:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # default (and maybe gone) in TRT 11
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(with_aot_attribute(onnx_path, aot), str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    input_dims = onnx_input_dims(onnx_path)
    profile_records = []
    for prof in profiles:
        shapes = profile_shapes(input_dims, prof, dim_symbols)
        p = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            p.set_shape(name, *shapes[name])
        config.add_optimization_profile(p)
        profile_records.append({"axes": prof, "shapes": {k: [list(s) for s in v] for k, v in shapes.items()}})
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path.name} (see the log above)")
    engine_path.write_bytes(bytes(blob))
    io = [{"name": network.get_input(i).name, "dtype": str(network.get_input(i).dtype),
           "shape": list(network.get_input(i).shape)} for i in range(network.num_inputs)]
    io += [{"name": network.get_output(i).name, "dtype": str(network.get_output(i).dtype),
            "shape": list(network.get_output(i).shape), "output": True} for i in range(network.num_outputs)]
    return {"engine": engine_path.name, "onnx": str(onnx_path), "bytes": engine_path.stat().st_size,
            "build_s": round(time.perf_counter() - t0, 1), "io": io, "profiles": profile_records}


def build_engines(onnx_dir, out_dir, profiles=None, *, dim_symbols: dict | None = None, aot: bool = True,
                  workspace_gib: float = 4.0, models=tuple(MODELS)) -> dict:
    """Build ``<out_dir>/<model>.engine`` for each of ``models`` ('target', 'speculator', and
    'speculator_fuse' where ``speculator.plugin.fuse.onnx`` exists, i.e. for EAGLE heads) from
    their ONNX graphs; write ``<out_dir>/engines.json``; return that manifest.

    ``profiles``: one dict or a list of dicts, axis ('batch', 'tree_tokens', 'past') -> (min, opt, max)
    (missing axes take DEFAULT_PROFILES). ``aot``: use the plugin's AOT kernel (engine runs without
    Python) rather than the JIT one. Raises EngineUnavailable when TensorRT or a GPU is missing.
    """
    onnx_dir, out_dir = Path(onnx_dir), Path(out_dir)
    profiles = _normalise_profiles(profiles)
    trt = check_available(onnx_dir, out_dir)
    missing = [MODELS[m] for m in models if m not in OPTIONAL_MODELS and not (onnx_dir / MODELS[m]).is_file()]
    models = [m for m in models if (onnx_dir / MODELS[m]).is_file()]
    if missing:
        raise FileNotFoundError(f"{onnx_dir} lacks {', '.join(missing)} (export them with --formats onnx)")

    from specfoundry.export.trt.plugin import register_plugin

    register_plugin()
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"tensorrt": trt.__version__, "gpu": _gpu_name(), "plugin": "specfoundry::TreeAttention",
                "aot": aot, "engines": {}}
    for m in models:
        manifest["engines"][m] = _build_one(trt, onnx_dir / MODELS[m], out_dir / f"{m}.engine", profiles,
                                            dim_symbols, aot, workspace_gib)
    (out_dir / "engines.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None
