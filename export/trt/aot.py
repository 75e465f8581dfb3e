"""Ahead-of-time compilation of the tree-attention kernel to PTX (and cubin), no GPU needed.

Scope: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` for one specialisation
(arch, I/O dtype, head dim, scale, tile sizes), plus the facts a launcher needs: the kernel name, the
PTX, the parameter list of its ``.entry`` (the ABI), threads per block and dynamic shared memory.

Two deliberate deviations from Triton's defaults, both for loading the PTX outside Triton:

* PTX ISA version. Triton 3.9 stamps PTX with the newest version its bundled ptxas knows (9.4 for
  sm_90a), which a CUDA 13.0 driver (R580) refuses. We pin ``ptx_version`` (default 8.4: drivers
  >= R550 JIT it) and check the result with ptxas.
* Trailing scratch parameters. Triton >= 3.3 appends ``global_scratch`` and ``profile_scratch``
  pointer parameters to every entry; Triton's own launcher passes NULLs. TensorRT's QDP AOT launch
  passes exactly inputs, extra int32 args and outputs, so an entry with two more parameters makes
  the driver read past the argument array. When both scratch sizes are 0 and the body never loads
  those parameters, ``trt_ptx`` drops them; otherwise compilation fails loudly.

Not here: the launch grid / extra-arg expressions (plugin.py owns them: ``plugin.kernel_launch_args``)
and running anything (gpu_check.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specfoundry.export.trt import kernel as K

DEFAULT_ARCHS = (80, 90)
DEFAULT_PTX_VERSION = 84  # PTX ISA 8.4 (CUDA 12.4): loadable by R550+ drivers, incl. CUDA 13.0's R580
MAX_STATIC_SHARED = 48 * 1024  # above this a launcher must opt in per function; TensorRT's QDP does not

TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
DTYPE_BY_NAME = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16,
                 "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
N_TRITON_SCRATCH_PARAMS = 2  # global_scratch, profile_scratch (Triton 3.9; fewer before 3.5)


class AotError(RuntimeError):
    """The kernel could not be compiled into something a plain CUDA launch can run."""


@dataclass(frozen=True)
class PtxParam:
    """One ``.param`` of a PTX ``.entry``: name, PTX type (u64 / u32 ...) and whether it is a pointer."""
    name: str
    ptx_type: str
    is_pointer: bool

    @property
    def kind(self) -> str:
        """'ptr' or the scalar type ('u32' for an i32 argument)."""
        return "ptr" if self.is_pointer else self.ptx_type


@dataclass
class AotKernel:
    """One compiled specialisation. ``ptx``/``params`` are what a TensorRT plugin launches;
    ``raw_ptx``/``raw_params`` are Triton's unmodified output (kept for diagnosis)."""
    name: str
    arch: int
    dtype: str
    head_dim: int
    scale: float
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    shared_mem: int
    ptx_version: int
    ptx: str
    params: tuple[PtxParam, ...]
    raw_ptx: str
    raw_params: tuple[PtxParam, ...]
    cubin: bytes | None = field(default=None, repr=False)
    cubin_from: str | None = None  # which ptxas assembled `ptx` (None: none was found)

    @property
    def threads_per_block(self) -> int:
        return self.num_warps * 32

    @property
    def abi(self) -> list[str]:
        """Parameter kinds of the launchable PTX entry, in order (e.g. ['ptr', ..., 'u32', ..., 'ptr'])."""
        return [p.kind for p in self.params]

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("ptx", "raw_ptx", "cubin", "params", "raw_params")}
        d["params"] = [asdict(p) for p in self.params]
        d["raw_params"] = [asdict(p) for p in self.raw_params]
        d["has_cubin"] = self.cubin is not None
        return d


# ---------------------------------------------------------------------------------------------
# PTX parsing

_ENTRY_RE = re.compile(r"\.entry\s+(?P<name>[A-Za-z_$][\w$]*)\s*\((?P<params>[^)]*)\)", re.S)
_PARAM_RE = re.compile(r"\.param\s+\.(?P<type>\w+)(?P<mods>(?:\s+\.\w+)*)(?:\s+\.align\s+\d+)?\s+(?P<name>[A-Za-z_$][\w$]*)")


def _entry(ptx: str, name: str | None = None) -> re.Match:
    for m in _ENTRY_RE.finditer(ptx):
        if name is None or m.group("name") == name:
            return m
    raise AotError(f"no .entry {name or ''} in the PTX")


def parse_entry_params(ptx: str, name: str | None = None) -> tuple[PtxParam, ...]:
    """The parameters of a PTX ``.entry`` (the first one, or the one called ``name``), in order."""
    out = []
    for chunk in _entry(ptx, name).group("params").split(","):
        chunk = chunk.strip()
        if not chunk:
            continue
        m = _PARAM_RE.search(chunk)
        if m is None:
            raise AotError(f"cannot parse PTX parameter {chunk!r}")
        mods = m.group("mods") or ""
        out.append(PtxParam(m.group("name"), m.group("type"), ".ptr" in mods))
    return tuple(out)


def strip_trailing_params(ptx: str, name: str, count: int) -> str:
    """Drop the last ``count`` parameters of entry ``name``, refusing if the body references any."""
    m = _entry(ptx, name)
    params = parse_entry_params(ptx, name)
    if count <= 0:
        return ptx
    if len(params) < count:
        raise AotError(f"entry {name} has {len(params)} parameters, cannot drop {count}")
    dropped = params[-count:]
    body = ptx[m.end():]
    for p in dropped:
        if re.search(rf"\b{re.escape(p.name)}\b", body):
            raise AotError(f"PTX body uses parameter {p.name}; it cannot be dropped")
    kept = [c for c in m.group("params").split(",") if c.strip()][: len(params) - count]
    new_params = ",".join(kept).rstrip() + "\n"
    return ptx[: m.start("params")] + new_params + ptx[m.end("params"):]


# ---------------------------------------------------------------------------------------------
# Compilation

def signature(dtype: torch.dtype) -> dict[str, str]:
    """Triton signature for the runtime parameters (constexprs added by ``compile_tree_attention``)."""
    t = TRITON_DTYPE[dtype]
    sig = {}
    for name in K.KERNEL_PARAMS:
        if name == "MASK":
            sig[name] = "*i32"
        elif name in K.INT_SCALARS:
            sig[name] = "i32"
        else:
            sig[name] = f"*{t}"
    return sig


def find_ptxas() -> str | None:
    """A system ptxas (CUDA toolkit) to cross-check the PTX against, or None."""
    return shutil.which("ptxas")


def assemble(ptx: str, arch: int, ptxas: str | None = None) -> bytes:
    """Assemble PTX to a cubin with the given (default: system) ptxas; raises AotError on failure."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise AotError("no ptxas on PATH")
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        r = subprocess.run([ptxas, f"--gpu-name={gpu}", str(src), "-o", str(dst)], capture_output=True, text=True)
        if r.returncode != 0:
            raise AotError(f"ptxas ({ptxas}) rejected the PTX for {gpu}: {r.stderr.strip()[:500]}")
        return dst.read_bytes()


def compile_tree_attention(arch: int, dtype: torch.dtype | str, head_dim: int, scale: float, *,
                           block_m: int = K.DEFAULT_BLOCK_M, block_n: int = K.DEFAULT_BLOCK_N,
                           num_warps: int = 4, num_stages: int = 2, ptx_version: int = DEFAULT_PTX_VERSION,
                           assume_aligned: bool = True, check_with_ptxas: bool = True) -> AotKernel:
    """Compile one specialisation for ``sm_<arch>`` (no GPU needed).

    ``assume_aligned`` marks every pointer 16-byte aligned (vectorised loads); TensorRT hands plugins
    separately allocated, 256-byte-aligned I/O buffers, and the JIT launcher's torch allocations are
    aligned too. ``check_with_ptxas`` assembles the launchable PTX with the system ptxas when one exists
    (that also proves the stripped entry is well-formed).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dtype = DTYPE_BY_NAME[dtype] if isinstance(dtype, str) else dtype
    if dtype not in TRITON_DTYPE:
        raise ValueError(f"unsupported dtype {dtype}")
    consts = K.constexprs(scale, head_dim, dtype, block_m=block_m, block_n=block_n)
    sig = signature(dtype)
    sig.update({name: "constexpr" for name in consts})
    attrs = {}
    if assume_aligned:
        ptr_idx = [i for i, n in enumerate(K.KERNEL_PARAMS) if n not in K.INT_SCALARS]
        attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx}
    src = ASTSource(K.tree_attention_kernel, sig, consts, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, "ptx_version": ptx_version,
               # explicit (same as Triton 3.9's default) so JIT and AOT builds round alike
               "enable_fp_fusion": True}
    # fewer pipeline stages when the tile would need more than 48 KiB of shared memory (fp32, big tiles)
    for stages in range(num_stages, 0, -1):
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={**options, "num_stages": stages})
        if compiled.metadata.shared <= MAX_STATIC_SHARED:
            break
    num_stages = stages
    md = compiled.metadata
    name = md.name
    raw_ptx = compiled.asm["ptx"]
    raw_params = parse_entry_params(raw_ptx, name)

    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise AotError(f"kernel needs Triton scratch memory (global {md.global_scratch_size}, profile "
                       f"{md.profile_scratch_size} bytes); a TensorRT AOT launch cannot provide it")
    if md.shared > MAX_STATIC_SHARED:
        raise AotError(f"kernel needs {md.shared} bytes of shared memory (> 48 KiB needs a per-function "
                       f"opt-in TensorRT does not do) even with one stage; lower block_n")
    # Triton 3.9 appends 2 scratch pointers (older releases 0 or 1): drop whatever trails the kernel's own
    n_extra = len(raw_params) - len(K.KERNEL_PARAMS)
    if not 0 <= n_extra <= N_TRITON_SCRATCH_PARAMS or not all(p.is_pointer for p in raw_params[len(K.KERNEL_PARAMS):]):
        raise AotError(f"PTX entry has {len(raw_params)} parameters; expected {len(K.KERNEL_PARAMS)} "
                       f"(+ up to {N_TRITON_SCRATCH_PARAMS} trailing Triton scratch pointers)")
    ptx = strip_trailing_params(raw_ptx, name, n_extra)
    params = parse_entry_params(ptx, name)

    cubin, cubin_from = None, None
    ptxas = find_ptxas() if check_with_ptxas else None
    if ptxas:
        cubin, cubin_from = assemble(ptx, arch, ptxas), ptxas
    return AotKernel(name=name, arch=arch, dtype=TRITON_DTYPE[dtype], head_dim=head_dim, scale=float(scale),
                     block_m=block_m, block_n=block_n, num_warps=md.num_warps, num_stages=num_stages,
                     shared_mem=md.shared, ptx_version=ptx_version, ptx=ptx, params=params, raw_ptx=raw_ptx,
                     raw_params=raw_params, cubin=cubin, cubin_from=cubin_from)


def write_artifacts(out_dir: str | Path, kernels: list[AotKernel]) -> dict:
    """Write each kernel's PTX (and cubin) plus ``kernels.json`` (name, ABI, launch facts) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for k in kernels:
        stem = f"tree_attention_sm{k.arch}_{k.dtype}_d{k.head_dim}_m{k.block_m}n{k.block_n}"
        (out / f"{stem}.ptx").write_text(k.ptx)
        rec = k.summary()
        rec["ptx_file"] = f"{stem}.ptx"
        if k.cubin is not None:
            (out / f"{stem}.cubin").write_bytes(k.cubin)
            rec["cubin_file"] = f"{stem}.cubin"
        entries.append(rec)
    manifest = {"op": "specfoundry::TreeAttention", "kernel_params": list(K.KERNEL_PARAMS), "kernels": entries}
    (out / "kernels.json").write_text(json.dumps(manifest, indent=2))
    return manifest


# ---------------------------------------------------------------------------------------------
# Export step (`specfoundry export --formats ptx`)

DEFAULT_SPEC = {"head_dim": 64, "scale": 0.125, "dtypes": ("fp16", "bf16")}  # SmolLM2-135M geometry


def tree_attention_specs(onnx_dir: str | Path) -> list[dict]:
    """(head_dim, scale, dtype) of every TreeAttention node in ``onnx_dir/*.onnx`` (weights not loaded).

    The head dim and dtype come from ONNX shape inference on the node's query input; where that
    cannot resolve them the head dim falls back to 1/scale^2 (the usual scale) and is marked so.
    """
    import onnx

    onnx_dir = Path(onnx_dir)
    specs: dict[tuple, dict] = {}
    for path in sorted(onnx_dir.glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        if not any(n.op_type == "TreeAttention" for n in model.graph.node):
            continue
        try:
            model = onnx.shape_inference.infer_shapes(model)
        except Exception:
            pass
        infos = {v.name: v for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
        for node in model.graph.node:
            if node.op_type != "TreeAttention":
                continue
            scale = next((a.f for a in node.attribute if a.name == "scale"), None)
            if scale is None:
                continue
            head_dim, dtype, source = None, None, "shape inference"
            info = infos.get(node.input[0])
            if info is not None and info.type.tensor_type.HasField("shape"):
                dims = info.type.tensor_type.shape.dim
                if len(dims) == 4 and dims[3].HasField("dim_value"):
                    head_dim = int(dims[3].dim_value)
                dtype = {onnx.TensorProto.FLOAT16: "fp16", onnx.TensorProto.BFLOAT16: "bf16",
                         onnx.TensorProto.FLOAT: "fp32"}.get(info.type.tensor_type.elem_type)
            if head_dim is None:
                head_dim, source = int(round(scale ** -2)), "1/scale^2 (shape inference could not resolve it)"
            for dt in ([dtype] if dtype else list(DEFAULT_SPEC["dtypes"])):
                key = (head_dim, round(float(scale), 9), dt)
                specs.setdefault(key, {"head_dim": head_dim, "scale": float(scale), "dtype": dt,
                                       "source": source, "graphs": []})
                if path.name not in specs[key]["graphs"]:
                    specs[key]["graphs"].append(path.name)
    return list(specs.values())


def write_ptx(out_dir: str | Path, *, onnx_dir: str | Path | None = None, archs=DEFAULT_ARCHS,
              specs: list[dict] | None = None) -> dict:
    """Compile the kernel for each spec and arch and write PTX/cubin + ``kernels.json`` to out_dir.

    Specs come from the TreeAttention nodes of ``onnx_dir`` (default: ``out_dir/../onnx`` when it
    exists), else DEFAULT_SPEC. Returns the manifest (what the export report records).
    """
    out_dir = Path(out_dir)
    if specs is None:
        onnx_dir = Path(onnx_dir) if onnx_dir is not None else out_dir.parent / "onnx"
        specs = tree_attention_specs(onnx_dir) if onnx_dir.is_dir() else []
        if not specs:
            specs = [{"head_dim": DEFAULT_SPEC["head_dim"], "scale": DEFAULT_SPEC["scale"], "dtype": dt,
                      "source": "default (no TreeAttention node found)"} for dt in DEFAULT_SPEC["dtypes"]]
    kernels = [compile_tree_attention(arch, s["dtype"], s["head_dim"], s["scale"]) for s in specs for arch in archs]
    manifest = write_artifacts(out_dir, kernels)
    manifest["specs"] = specs
    (out_dir / "kernels.json").write_text(json.dumps(manifest, indent=2))
    return {"dir": str(out_dir), "files": sorted(p.name for p in out_dir.iterdir()), "specs": specs}
