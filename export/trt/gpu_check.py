"""One prepared check of the tree-attention kernel stack on an NVIDIA GPU (``make gpu-check``).

    python -m specfoundry.export.trt.gpu_check --out runs/gpu-check [--golden FILE.npz] [--onnx-dir DIR]

Sections, in order; each reports ok / failed / skipped (with the reason) in ``<out>/gpu_check.json``:

1. ``golden_cpu``     onnxruntime (CPU) runs one-node ``specfoundry::TreeAttention`` graphs through the
                      ONNX reference function; inputs and outputs are saved to ``<out>/golden.npz``
                      (or loaded from ``--golden``) before any GPU work. CPU only, runs everywhere.
2. ``aot_compile``    the kernel compiled to PTX for sm_80, sm_90 (and the local GPU's arch), with the
                      plugin's launch ABI checked against each PTX entry. CPU only, runs everywhere.
3. ``triton_kernel``  the Triton kernel on the GPU vs the PyTorch reference, fp16 / bf16 / fp32.
4. ``aot_ptx_launch`` the AOT PTX loaded through the CUDA driver API (ctypes on libcuda: no extra
                      package) and launched with exactly the plugin's arguments and launch dims.
5. ``golden_vs_cuda`` the ORT golden outputs vs the CUDA Triton kernel and the CUDA torch reference.
6. ``tensorrt``       only where ``tensorrt`` imports: one-node engines through the plugin (JIT and AOT)
                      vs the golden outputs, and ``build_engines(--onnx-dir)`` when given.

Requirements: an NVIDIA driver, a CUDA build of torch and triton (the PTX is pinned to ISA 8.4, so
R550+ drivers load it); onnx + onnxruntime (CPU) for the golden files; TensorRT >= 10.9 only for
section 6. On a machine without CUDA every GPU section is skipped with the reason and the exit code
is 0; any failed section makes it 1. Sized to finish well inside 7 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import importlib
import ctypes
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from specfoundry.export.trt import aot, plugin
from specfoundry.export.trt import kernel as K

# golden cases: (name, batch, q_heads, kv_heads, new_tokens, past, head_dim, dtype)
GOLDEN_CASES = [
    ("gqa3_two_words_fp32", 2, 6, 2, 40, 19, 32, "float32"),
    ("smollm2_geometry_fp16", 1, 9, 3, 24, 70, 64, "float16"),
]
# a realistic extra GPU case: SmolLM2-135M heads, a 64-token tree over a long cache
BIG_CASE = (2, 9, 3, 64, 1000, 64)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
ONNX_OPSET = 21


class Skip(Exception):
    """A section that cannot run here; the message is the reason."""


def _need_cuda():
    if not torch.cuda.is_available():
        why = "torch has no CUDA support (CPU build)" if torch.version.cuda is None else "no CUDA device is visible"
        raise Skip(f"{why}: torch {torch.__version__}, torch.cuda.is_available() is False")


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float().cpu()).abs().max())


# ---------------------------------------------------------------------------------------------
# 1. golden outputs from onnxruntime on CPU

def one_node_model(dtype: str, scale: float, head_dim: int, q_heads: int, kv_heads: int):
    """A graph with one specfoundry::TreeAttention node (named dynamic dims) + the ONNX reference function."""
    import onnx
    from onnx import TensorProto, helper

    ta = importlib.import_module("specfoundry.export.onnx.tree_attention")  # the package re-exports a function of that name

    et = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT}[dtype]
    inputs = [
        helper.make_tensor_value_info("query", et, ["batch", q_heads, "tree_tokens", head_dim]),
        helper.make_tensor_value_info("key", et, ["batch", kv_heads, "past + tree_tokens", head_dim]),
        helper.make_tensor_value_info("value", et, ["batch", kv_heads, "past + tree_tokens", head_dim]),
        helper.make_tensor_value_info("tree_mask", TensorProto.INT32, ["batch", "tree_tokens", "(tree_tokens + 31) // 32"]),
    ]
    output = helper.make_tensor_value_info("output", et, ["batch", q_heads, "tree_tokens", head_dim])
    node = helper.make_node(ta.OP_TYPE, ["query", "key", "value", "tree_mask"], ["output"], domain=ta.DOMAIN,
                            scale=float(scale), plugin_namespace=ta.PLUGIN_NAMESPACE, plugin_version=ta.PLUGIN_VERSION)
    graph = helper.make_graph([node], "tree_attention_one_node", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET),
                                                    helper.make_opsetid(ta.DOMAIN, ta.DOMAIN_VERSION)])
    ta.attach_reference_function(model)
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(model)
    return model


def make_golden(path: Path) -> dict:
    import onnxruntime as ort

    arrays, meta = {}, []
    for name, b, hq, hkv, t, p, d, dt in GOLDEN_CASES:
        q, k, v, m, scale = K.make_case(b, hq, hkv, t, p, d, DTYPES[dt], seed=7)
        model = one_node_model(dt, scale, d, hq, hkv)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {"query": q.numpy(), "key": k.numpy(), "value": v.numpy(), "tree_mask": m.numpy()}
        (out,) = sess.run(None, feeds)
        for key, val in {**feeds, "output": out}.items():
            arrays[f"{name}.{key}"] = val
        ref_err = _err(torch.from_numpy(out), K.reference_tree_attention(q, k, v, m, scale))
        meta.append({"case": name, "scale": scale, "dtype": dt, "ort_vs_torch_cpu": ref_err,
                     "onnx": model.SerializeToString()})
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays, _meta=np.array(json.dumps([{k: v for k, v in m.items() if k != "onnx"} for m in meta])))
    for m in meta:
        (path.parent / f"golden_{m['case']}.onnx").write_bytes(m.pop("onnx"))  # for inspection / polygraphy
    return {"file": str(path), "cases": meta}


def load_golden(path: Path) -> tuple[dict, list]:
    data = np.load(path, allow_pickle=False)
    meta = json.loads(str(data["_meta"]))
    return {k: data[k] for k in data.files if k != "_meta"}, meta


def section_golden_cpu(state, args):
    path = Path(args.golden) if args.golden else Path(args.out) / "golden.npz"
    if args.golden and path.is_file():
        state["golden"] = path
        return {"file": str(path), "loaded": True}
    info = make_golden(path)
    state["golden"] = path
    bad = [c for c in info["cases"] if c["ort_vs_torch_cpu"] > K.TOLERANCE[DTYPES[c["dtype"]]]]
    if bad:
        raise AssertionError(f"ORT reference disagrees with the torch reference on CPU: {bad}")
    return info


# ---------------------------------------------------------------------------------------------
# 2. AOT compilation + ABI check (CPU)

def section_aot_compile(state, args):
    archs = set(aot.DEFAULT_ARCHS)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        archs.add(major * 10 + minor)
    results = []
    launch = plugin.kernel_launch_args((1, 9, 16, 64), (1, 3, 80, 64))
    state["aot"] = {}
    for arch in sorted(archs):
        for dt in ("fp16", "bf16"):
            k = aot.compile_tree_attention(arch, dt, 64, 0.125)
            mismatch = plugin.abi_mismatch(launch, k)
            if mismatch:
                raise AssertionError(f"sm_{arch} {dt}: {mismatch}")
            state["aot"][(arch, dt)] = k
            results.append({"arch": arch, "dtype": dt, "name": k.name, "abi": k.abi, "raw_params": len(k.raw_params),
                            "shared_mem": k.shared_mem, "ptx_version": k.ptx_version, "cubin_by": k.cubin_from})
    out = Path(args.out) / "ptx"
    aot.write_artifacts(out, list(state["aot"].values()))
    return {"kernels": results, "written": str(out)}


# ---------------------------------------------------------------------------------------------
# 3. Triton kernel on the GPU

def section_triton_kernel(state, args):
    _need_cuda()
    records = []
    for name in K.CASES:
        for dt in ("float16", "bfloat16", "float32"):
            records.append(K.run_case(name, DTYPES[dt], device="cuda", seed=3))
    for dt in ("float16", "bfloat16"):
        q, k, v, m, scale = K.make_case(*BIG_CASE, DTYPES[dt], device="cuda", seed=5)
        for block_n in plugin.TACTICS.values():
            err = _err(K.tree_attention(q, k, v, m, scale, block_n=block_n), K.reference_tree_attention(q, k, v, m, scale))
            tol = K.TOLERANCE[DTYPES[dt]]
            records.append({"case": f"big{BIG_CASE}_n{block_n}", "dtype": dt, "max_abs_err": err, "tol": tol,
                            "ok": err <= tol})
    failed = [r for r in records if not r["ok"]]
    if failed:
        raise AssertionError(f"{len(failed)} of {len(records)} cases over tolerance: {failed}")
    return {"cases": records}


# ---------------------------------------------------------------------------------------------
# 4. AOT PTX through the CUDA driver, launched with the plugin's ABI

class CudaDriver:
    """The few CUDA driver calls needed to load PTX and launch it (ctypes; the context is torch's)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()  # torch's primary context is now current on this thread
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context after torch initialised the device")

    def _check(self, rc, what):
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {rc} {name.value.decode() if name.value else ''}")

    def load(self, image: bytes, name: str):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        buf = ctypes.create_string_buffer(image + (b"" if image.endswith(b"\0") else b"\0"))
        self._check(self.lib.cuModuleLoadData(ctypes.byref(mod), buf), "cuModuleLoadData")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        return mod, fn

    def launch(self, fn, grid, block, shared, stream, values):
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        self._check(self.lib.cuLaunchKernel(fn, ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(grid[2]),
                                            ctypes.c_uint(block[0]), ctypes.c_uint(block[1]), ctypes.c_uint(block[2]),
                                            ctypes.c_uint(shared), ctypes.c_void_p(stream), ptrs, None),
                    "cuLaunchKernel")

    def unload(self, mod):
        self._check(self.lib.cuModuleUnload(mod), "cuModuleUnload")


def launch_aot(drv: CudaDriver, compiled: aot.AotKernel, q, k, v, m, out, *, image: bytes | None = None):
    """Launch a compiled kernel exactly as the TensorRT plugin would (its args, grid, block, shared)."""
    args = plugin.kernel_launch_args(tuple(q.shape), tuple(k.shape))
    mismatch = plugin.abi_mismatch(args, compiled)
    if mismatch:
        raise AssertionError(mismatch)
    dims = plugin.launch_dims(tuple(q.shape), block_m=compiled.block_m, num_warps=compiled.num_warps)
    ios = {("input", 0): q, ("input", 1): k, ("input", 2): v, ("input", 3): m, ("output", 0): out}
    values = [ctypes.c_uint64(ios[a.source].data_ptr()) if a.kind == "ptr" else ctypes.c_int32(int(a.value))
              for a in args]
    mod, fn = drv.load(image if image is not None else compiled.ptx.encode(), compiled.name)
    try:
        drv.launch(fn, dims["grid"], dims["block"], compiled.shared_mem, torch.cuda.current_stream().cuda_stream, values)
        torch.cuda.synchronize()
    finally:
        drv.unload(mod)
    return out


def section_aot_ptx_launch(state, args):
    _need_cuda()
    drv = CudaDriver()
    major, minor = torch.cuda.get_device_capability()
    here = major * 10 + minor
    records = []
    for dt, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        q, k, v, m, _ = K.make_case(*BIG_CASE[:5], 64, tdt, device="cuda", seed=11)
        want = K.reference_tree_attention(q, k, v, m, 0.125)
        variants = [(f"sm_{here} ptx", state.get("aot", {}).get((here, dt)) or aot.compile_tree_attention(here, dt, 64, 0.125), None)]
        if here >= 80 and here != 80:  # sm_80 PTX must JIT forward onto newer GPUs (not so the sm_90a one)
            k80 = state.get("aot", {}).get((80, dt)) or aot.compile_tree_attention(80, dt, 64, 0.125)
            variants.append(("sm_80 ptx", k80, None))
        here_k = variants[0][1]
        if here_k.cubin is not None:
            variants.append((f"sm_{here} cubin", here_k, here_k.cubin))
        for label, compiled, image in variants:
            out = torch.full_like(q, float("nan"))
            try:
                launch_aot(drv, compiled, q, k, v, m, out, image=image)
            except RuntimeError as exc:
                if image is None or "cuModuleLoadData" not in str(exc):
                    raise
                # a cubin from this machine's (possibly newer) ptxas may not load on an older driver;
                # the PTX is what the plugin ships, so this is reported, not failed
                records.append({"variant": label, "dtype": dt, "ok": None, "note": str(exc)})
                continue
            err = _err(out, want)
            records.append({"variant": label, "dtype": dt, "max_abs_err": err, "tol": K.TOLERANCE[tdt],
                            "ok": err <= K.TOLERANCE[tdt]})
    failed = [r for r in records if r["ok"] is False]
    if failed:
        raise AssertionError(f"AOT launches over tolerance: {failed}")
    return {"driver": "ctypes libcuda", "launches": records}


# ---------------------------------------------------------------------------------------------
# 5. golden (ORT, CPU) vs CUDA

def section_golden_vs_cuda(state, args):
    _need_cuda()
    if "golden" not in state:
        raise Skip("no golden file (golden_cpu did not produce one)")
    arrays, meta = load_golden(state["golden"])
    records = []
    for case in meta:
        name, scale, tdt = case["case"], case["scale"], DTYPES[case["dtype"]]
        q, k, v, m = (torch.from_numpy(arrays[f"{name}.{x}"]).cuda() for x in ("query", "key", "value", "tree_mask"))
        golden = torch.from_numpy(arrays[f"{name}.output"])
        tol = K.TOLERANCE[tdt]
        for impl, fn in (("triton_cuda", K.tree_attention), ("torch_reference_cuda", K.reference_tree_attention)):
            err = _err(fn(q, k, v, m, scale), golden)
            records.append({"case": name, "impl": impl, "max_abs_err": err, "tol": tol, "ok": err <= tol})
    failed = [r for r in records if not r["ok"]]
    if failed:
        raise AssertionError(f"CUDA outputs differ from the ORT golden outputs: {failed}")
    return {"golden": str(state["golden"]), "comparisons": records}


# ---------------------------------------------------------------------------------------------
# 6. TensorRT (only where it imports)

def _run_engine(trt, blob: bytes, feeds: dict, out_like: torch.Tensor) -> torch.Tensor:
    logger = trt.Logger(trt.Logger.WARNING)
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    ctx = engine.create_execution_context()
    out = torch.empty_like(out_like)
    for name, t in feeds.items():
        ctx.set_input_shape(name, tuple(t.shape))
        ctx.set_tensor_address(name, t.data_ptr())
    ctx.set_tensor_address("output", out.data_ptr())
    stream = torch.cuda.current_stream()
    if not ctx.execute_async_v3(stream.cuda_stream):
        raise RuntimeError("execute_async_v3 returned False")
    stream.synchronize()
    return out


def section_tensorrt(state, args):
    try:
        import tensorrt as trt
    except Exception as exc:
        raise Skip(f"tensorrt is not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    _need_cuda()
    from specfoundry.export.trt import engine as E

    if "golden" not in state:
        raise Skip("no golden file (golden_cpu did not produce one)")
    plugin.register_plugin()
    arrays, meta = load_golden(state["golden"])
    records, tmp = [], Path(args.out) / "trt"
    tmp.mkdir(parents=True, exist_ok=True)
    for case in meta:
        name, tdt = case["case"], DTYPES[case["dtype"]]
        feeds = {x: torch.from_numpy(arrays[f"{name}.{x}"]).cuda() for x in ("query", "key", "value", "tree_mask")}
        golden = torch.from_numpy(arrays[f"{name}.output"])
        b, hq, t, d = feeds["query"].shape
        hkv, p = feeds["key"].shape[1], feeds["key"].shape[2] - t
        graph = tmp / f"{name}.onnx"
        graph.write_bytes(one_node_model(case["dtype"], case["scale"], d, hq, hkv).SerializeToString())
        prof = [{"batch": (1, b, b), "tree_tokens": (1, t, t), "past": (0, p, p)}]
        for use_aot in (False, True):
            rec = E._build_one(trt, graph, tmp / f"{name}_aot{int(use_aot)}.engine", prof, None, use_aot, 2.0)
            out = _run_engine(trt, (tmp / rec["engine"]).read_bytes(), feeds, feeds["query"])
            err = _err(out, golden)
            records.append({"case": name, "aot": use_aot, "max_abs_err": err, "tol": K.TOLERANCE[tdt],
                            "ok": err <= K.TOLERANCE[tdt], "build_s": rec["build_s"]})
    result = {"tensorrt": trt.__version__, "one_node_engines": records}
    if args.onnx_dir:
        result["build_engines"] = E.build_engines(args.onnx_dir, Path(args.out) / "engines")
    failed = [r for r in records if not r["ok"]]
    if failed:
        raise AssertionError(f"TensorRT engine outputs differ from the golden outputs: {failed}")
    return result


# ---------------------------------------------------------------------------------------------

SECTIONS = [
    ("golden_cpu", section_golden_cpu),
    ("aot_compile", section_aot_compile),
    ("triton_kernel", section_triton_kernel),
    ("aot_ptx_launch", section_aot_ptx_launch),
    ("golden_vs_cuda", section_golden_vs_cuda),
    ("tensorrt", section_tensorrt),
]


def environment() -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "triton": triton.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability())
        try:
            drv = ctypes.CDLL("libcuda.so.1")
            ver = ctypes.c_int()
            drv.cuDriverGetVersion(ctypes.byref(ver))
            env["cuda_driver"] = f"{ver.value // 1000}.{ver.value % 1000 // 10}"
        except OSError:
            pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specfoundry.export.trt.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/gpu-check", help="output folder (gpu_check.json, golden.npz, ptx/)")
    ap.add_argument("--golden", default=None, help="golden .npz saved beforehand (default: make one now, on CPU)")
    ap.add_argument("--onnx-dir", default=None, help="also build_engines() on this export's onnx/ (TensorRT only)")
    ap.add_argument("--only", default=None, help="comma list of sections to run (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None

    summary = {"env": environment(), "sections": {}}
    state: dict = {}
    t_all = time.perf_counter()
    for name, fn in SECTIONS:
        if only and name not in only:
            summary["sections"][name] = {"status": "skipped", "reason": "not selected (--only)"}
            continue
        t0 = time.perf_counter()
        try:
            details = fn(state, args)
            rec = {"status": "ok", "details": details}
        except Skip as s:
            rec = {"status": "skipped", "reason": str(s)}
        except Exception as exc:  # a failed section must not stop the others
            rec = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        summary["sections"][name] = rec
        line = rec.get("reason", "")
        print(f"[gpu-check] {name:15s} {rec['status']:8s} {rec['seconds']:7.1f} s  {line[:200]}", file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - t_all, 1)
    failed = [n for n, r in summary["sections"].items() if r["status"] == "failed"]
    summary["ok"] = not failed
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"[gpu-check] wrote {out / 'gpu_check.json'}; "
          f"{'all sections ok or skipped' if not failed else 'FAILED: ' + ', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
