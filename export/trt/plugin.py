"""TensorRT Quickly Deployable Plugin ``specfoundry::TreeAttention`` backed by the Triton kernel.

Scope: ``register_plugin()`` registers, with ``tensorrt.plugin`` (TensorRT >= 10.9 for AOT):

* ``register``  - output = query's shape and dtype; attribute ``scale: float`` (the ONNX node's).
* ``autotune``  - fp16, bf16 and fp32 (q, k, v, out share the type; the mask is int32), LINEAR
  layouts, one tactic per ``BLOCK_N`` in ``TACTICS``.
* ``impl``      - JIT: launches the Triton kernel through torch on TensorRT's stream (Python at run time).
* ``aot_impl``  - AOT: returns (kernel name, PTX, ``trtp.KernelLaunchParams``, ``trtp.SymIntExprs``);
  the engine then runs without Python. The ONNX node picks it with the int attribute ``aot=1``
  (``engine.build_engines`` adds it).

The launch-argument construction is the pure function ``kernel_launch_args`` (and
``launch_dims``): it works on plain ints and on TensorRT shape expressions alike, so the ABI can be
checked against the compiled PTX without TensorRT (tests/test_export_trt.py) and the same function
drives the GPU check's raw PTX launch (gpu_check.py).

TensorRT is imported only inside ``register_plugin()``; importing this module never needs it.
No ``from __future__ import annotations`` here: TensorRT inspects the decorated functions'
annotations as classes.
"""

import functools
from dataclasses import dataclass

from specfoundry.export.trt import kernel as K

PLUGIN_ID = "specfoundry::TreeAttention"
PLUGIN_NAMESPACE, PLUGIN_NAME = PLUGIN_ID.split("::")

# tactic id -> BLOCK_N (TensorRT tactics must be positive ints; 0 = "no tactic chosen" -> default)
TACTICS = {1: 32, 2: 64}
DEFAULT_TACTIC = 1


class TensorRTUnavailable(RuntimeError):
    """TensorRT's Python package (with ``tensorrt.plugin``) cannot be imported."""


@dataclass(frozen=True)
class LaunchArg:
    """One kernel parameter as the plugin passes it.

    kind: 'ptr' (a tensor; ``source`` = ('input', i) or ('output', i) in plugin I/O order) or
    'i32' (``value`` = an int or a TensorRT shape expression, wrapped in ``trtp.SymInt32`` for AOT).
    """
    name: str
    kind: str
    source: tuple | None = None
    value: object = None


def _cdiv(a, b):
    # works for ints and for TensorRT ShapeExprs (which support +, -, //)
    return (a + (b - 1)) // b


def kernel_launch_args(query_shape, key_shape) -> list:
    """The kernel's runtime parameters in launch order (TensorRT AOT convention: input pointers,
    int32 scalars, output pointers), from the query [B,Hq,T,D] and key [B,Hkv,S,D] shapes.

    Scalars are T (new tokens), S (past + new), Hq, Hkv: shape expressions only, because a
    TensorRT AOT launch can pass nothing else (the past length P = S - T is derived in-kernel).
    """
    _, hq, t, _ = query_shape
    _, hkv, s, _ = key_shape
    scalars = {"T": t, "S": s, "HQ": hq, "HKV": hkv}
    args = [LaunchArg(n, "ptr", ("input", i)) for i, n in enumerate(K.INPUT_PTRS)]
    args += [LaunchArg(n, "i32", value=scalars[n]) for n in K.INT_SCALARS]
    args += [LaunchArg(n, "ptr", ("output", i)) for i, n in enumerate(K.OUTPUT_PTRS)]
    return args


def launch_dims(query_shape, *, block_m: int = K.DEFAULT_BLOCK_M, num_warps: int = 4, cdiv=_cdiv) -> dict:
    """Grid and block for a launch: grid (ceil(T / BLOCK_M), B * Hq, 1), block (32 * num_warps, 1, 1).
    ``cdiv`` may be ``trtp.cdiv`` for shape expressions."""
    b, hq, t, _ = query_shape
    return {"grid": (cdiv(t, block_m), b * hq, 1), "block": (32 * num_warps, 1, 1)}


def ptx_abi(args: list) -> list:
    """The PTX parameter kinds a launch with ``args`` expects ('ptr' -> 'ptr', 'i32' -> 'u32'), for
    comparison with ``aot.AotKernel.abi``."""
    return ["ptr" if a.kind == "ptr" else "u32" for a in args]


def abi_mismatch(args: list, compiled):
    """None when ``args`` fit the launchable PTX entry of ``compiled`` (an ``aot.AotKernel``) one to
    one (count, order, pointer vs int32), else a sentence saying how they differ."""
    want, have = ptx_abi(args), list(compiled.abi)
    if want == have:
        return None
    return (f"{PLUGIN_ID}: the plugin passes {len(want)} launch args {want} but the PTX entry "
            f"{compiled.name} takes {len(have)}: {have}")


# ---------------------------------------------------------------------------------------------
# TensorRT registration (lazy)

_REGISTERED = False


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
        import tensorrt.plugin  # noqa: F401
    except Exception:  # ImportError, or an OSError from a missing libnvinfer
        return False
    return True


def _import_trt():
    try:
        import tensorrt as trt
        import tensorrt.plugin as trtp
    except Exception as exc:
        raise TensorRTUnavailable(
            f"TensorRT's Python package with tensorrt.plugin (TensorRT >= 10.9) is not importable "
            f"({type(exc).__name__}: {exc}); install it from NVIDIA's package index to use the "
            f"{PLUGIN_ID} plugin") from exc
    return trt, trtp


def _torch_dtype(trt, dtype):
    import torch

    table = {trt.float16: torch.float16, trt.bfloat16: torch.bfloat16, trt.float32: torch.float32}
    if dtype not in table:
        raise TypeError(f"{PLUGIN_ID}: unsupported activation type {dtype}")
    return table[dtype]


class _CudaArray:
    """A bare ``__cuda_array_interface__`` over a TensorRT buffer (TensorRT's own refuses BF16)."""

    def __init__(self, ptr: int, shape: tuple, typestr: str, itemsize: int, strides=None):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (int(ptr), False), "version": 3,
            "strides": None if strides is None else tuple(int(x) * itemsize for x in strides)}


def _as_torch(trt, t):
    """A zero-copy torch view of a ``trtp.Tensor`` (bf16 travels as int16 and is viewed back)."""
    import torch

    typestr, itemsize, view = {trt.float16: ("<f2", 2, None), trt.float32: ("<f4", 4, None),
                               trt.int32: ("<i4", 4, None), trt.bfloat16: ("<i2", 2, torch.bfloat16)}[t.dtype]
    strides = tuple(t.strides) if getattr(t, "strides", None) is not None else None
    x = torch.as_tensor(_CudaArray(t.data_ptr, tuple(t.shape), typestr, itemsize, strides), device="cuda")
    return x.view(view) if view is not None else x


@functools.lru_cache(maxsize=None)
def _device_arch() -> int:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{PLUGIN_ID}: the AOT kernel is compiled for the build GPU, and torch sees no CUDA device")
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


@functools.lru_cache(maxsize=None)
def _compiled(arch, dtype_name, head_dim, scale, block_n):
    from specfoundry.export.trt import aot

    return aot.compile_tree_attention(arch, dtype_name, head_dim, scale, block_n=block_n, check_with_ptxas=False)


def _static_head_dim(desc) -> int:
    expr = desc.shape_expr[3]
    if not expr.is_fake and expr.is_constant:
        return int(expr.constant_value())
    d = int(desc.shape[3])
    if d <= 0:
        raise ValueError(f"{PLUGIN_ID}: the head dimension must be static (it is a kernel constexpr)")
    return d


def register_plugin() -> None:
    """Register the QDP with TensorRT (idempotent). Raises ``TensorRTUnavailable`` without TensorRT."""
    global _REGISTERED
    if _REGISTERED:
        return
    trt, trtp = _import_trt()
    from typing import List, Tuple, Union

    @trtp.register(PLUGIN_ID)
    def _desc(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
              tree_mask: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
        return query.like()

    @trtp.autotune(PLUGIN_ID)
    def _autotune(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                  tree_mask: trtp.TensorDesc, outputs: Tuple[trtp.TensorDesc]) -> List[trtp.AutoTuneCombination]:
        # positions: q, k, v, mask, out; '|' = the activations move together, the mask stays INT32
        act = "FP16|BF16|FP32"
        return [trtp.AutoTuneCombination(f"{act}, {act}, {act}, INT32, {act}", "LINEAR", list(TACTICS))]

    @trtp.impl(PLUGIN_ID)
    def _impl(query: trtp.Tensor, key: trtp.Tensor, value: trtp.Tensor, tree_mask: trtp.Tensor, scale: float,
              outputs: Tuple[trtp.Tensor], stream: int, tactic: int) -> None:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            q, k, v, m = (_as_torch(trt, x) for x in (query, key, value, tree_mask))
            out = _as_torch(trt, outputs[0])
            K.tree_attention(q, k, v, m, scale, out=out, block_n=TACTICS.get(tactic, TACTICS[DEFAULT_TACTIC]))

    @trtp.aot_impl(PLUGIN_ID)
    def _aot_impl(query: trtp.TensorDesc, key: trtp.TensorDesc, value: trtp.TensorDesc,
                  tree_mask: trtp.TensorDesc, scale: float, outputs: Tuple[trtp.TensorDesc], tactic: int
                  ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymExprs]:
        dtype = _torch_dtype(trt, query.dtype)
        block_n = TACTICS.get(tactic, TACTICS[DEFAULT_TACTIC])
        compiled = _compiled(_device_arch(), str(dtype).replace("torch.", ""), _static_head_dim(query),
                             float(scale), block_n)
        args = kernel_launch_args(query.shape_expr, key.shape_expr)
        dims = launch_dims(query.shape_expr, block_m=compiled.block_m, num_warps=compiled.num_warps,
                           cdiv=trtp.cdiv)
        mismatch = abi_mismatch(args, compiled)
        if mismatch:  # never hand TensorRT a kernel whose entry does not match what it will pass
            raise RuntimeError(mismatch)
        params = trtp.KernelLaunchParams()
        params.grid_x, params.grid_y, params.grid_z = dims["grid"]
        params.block_x, params.block_y, params.block_z = dims["block"]
        params.shared_mem = compiled.shared_mem
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(a.value) for a in args if a.kind == "i32"])
        return compiled.name, compiled.ptx, params, extra

    _REGISTERED = True
