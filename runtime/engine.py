"""A low-overhead forward for Llama-family targets with a static, in-place KV cache.

Scope: the decode-time forward of Llama, Mistral (no sliding window), Qwen2 and Qwen3 shapes
(SmolLM2 is a Llama) and the cache it writes; nothing else. :class:`EngineTarget` puts it
behind :class:`~specfoundry.runtime.target.TargetModel`'s interface, so the generator, every
drafter and the bench use it unchanged. Other architectures keep the HF path
(:func:`engine_support` says why, and :func:`~specfoundry.runtime.models.load_target` logs it).

What makes it cheaper than the HF path on a CPU, where per-op overhead and copies dominate a
135M model's ~25 ms weight-streaming floor:

- weights are taken from the HF model once: Q/K/V fused into one matrix and gate/up into one,
  the HF modules' parameters re-pointed at row slices of the fused tensors (no second copy); on a
  Linux CPU the matrices a step streams are laid out in one arena on 2 MB pages (:mod:`.hugepages`:
  plain decoding 1.10-1.16x faster on a Zen 4 EPYC than on the allocator's 4 KB pages);
- one preallocated cache ``[L, 2, B, Hkv, capacity, D]`` written in place at the new positions;
  after verification the accepted tree nodes are moved into place by one indexed copy of only
  those entries (O(accepted), never O(context)); a rejected suffix is simply overwritten later;
- RoPE tables for the whole capacity and the attention mask buffer are preallocated; a plain
  n=1 step uses no mask at all;
- grouped-query attention without repeating K/V: the ``g`` query heads that share a KV head are
  stacked as ``g * n`` query rows against that head (for n=1 a small GEMM instead of g GEMVs);
- linear kernels chosen by measurement on the machine, per one-row and several-row products
  (:data:`KERNELS`: oneDNN packed weights, transposed weights, ATen, and on AVX2 CPUs our own
  few-row kernel, :mod:`.cpu_gemv`, whose cost is flat over 1-8 rows), prepared once; the
  speculator heads reuse the choice (:class:`PreparedLinears`);
- where the CPU has avx512_bf16, a bf16 step of one sequence (1-8 tokens: plain steps and
  verifications) runs all layers in one C call on those products (:mod:`.cpu_layers`), with no
  PyTorch op between them; the kernel choice weighs whole forwards with it;
- the forward returns only the feature layers a speculator asked for (HF numbering: ``i`` = input
  of layer ``i``, ``L`` = the final normed state) and LM-head rows only where asked;
- batched data generation runs on the serving slots (:mod:`.serving.slots`: continuous batching).

The cache, its masks and the attention over it live in :mod:`.kvcache` (re-exported here); this
module holds the weights, the kernels and the forward.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from operator import attrgetter, methodcaller
from pathlib import Path

import torch
import torch.nn.functional as F

from . import choices, cpu_attention, cpu_gemv, cpu_layers, hugepages, native
from .kvcache import MaskBuffer, StaticKVCache, attend, grouped_attention, prefill_causal, rotate
from .target import TargetModel, TargetOutput
from .timing import best_seconds

__all__ = ["KERNELS", "EngineTarget", "LlamaEngine", "MaskBuffer", "PreparedLinears", "RopeTable", "StaticKVCache",
           "attend", "engine_support", "grouped_attention", "rms_norm", "rotate"]

_MATRICES = ("wqkv", "wo", "w_gu", "w_down", "lm_head")
_VERSION = attrgetter("_version")
_DATA_PTR = methodcaller("data_ptr")


@functools.lru_cache(maxsize=1)
def _kernel_sources() -> str:
    """A hash of the modules that define and choose the kernels: an edit measures the choice again."""
    files = [__file__] + [m.__file__ for m in (cpu_attention, cpu_gemv, cpu_layers, native)]
    return hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()[:16]


def tensors_stamp(tensors: list[torch.Tensor]) -> tuple:
    """What identifies ``tensors`` as they are now, cheaply (a drafting step asks every step, ~0.1 ms
    per check with one tuple per tensor on cold caches): the objects, their storage, and the sum of
    their in-place version counters (which only grow; inference tensors have none)."""
    try:
        version = sum(map(_VERSION, tensors))
    except RuntimeError:  # an inference tensor among them
        version = sum(0 if t.is_inference() else t._version for t in tensors)
    return tuple(map(id, tensors)), tuple(map(_DATA_PTR, tensors)), version


_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def engine_support(model) -> str | None:
    """None when the engine can run ``model`` (a HF causal LM), else the reason it cannot."""
    c = model.config
    arch = getattr(c, "model_type", None)
    if arch not in _ARCHS:
        return f"model_type {arch!r} is not one of {', '.join(_ARCHS)}"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"hidden_act {c.hidden_act!r} (the engine implements silu)"
    if getattr(c, "mlp_bias", False):
        return "mlp_bias=True"
    if getattr(c, "sliding_window", None) and (arch == "mistral" or getattr(c, "use_sliding_window", False)):
        return f"sliding-window attention ({c.sliding_window})"
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in _STATIC_ROPE:
        return f"rope_type {rope_type!r} depends on the sequence length"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "not a *ForCausalLM with .model.layers and .model.rotary_emb"
    attn = inner.layers[0].self_attn
    if getattr(attn.o_proj, "bias", None) is not None:
        return "o_proj has a bias"
    return None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` (statistics in float32, the scale applied after casting back) in one
    fused op where the dtype allows: the engine's and the drafting heads' one norm."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    if x.dtype == torch.float64:  # tests: HF's exact op order (its float32 round trip included)
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = cpu_layers.rms_norm(x, w, eps)  # bf16 on CPUs with avx512_bf16: one C call (~9 ops otherwise)
    return y if y is not None else w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """The MLP's ``silu(gate) * up`` of the fused product ``gu`` ``[..., 2I]``: one C pass in bf16 where the
    CPU has the kernel, else PyTorch's ops (with the one-call prefill attention, a prompt's prefill is 5-8%
    faster at 2 threads on a Zen 4 EPYC: docs/results.md, fifty-fifth session)."""
    m = cpu_layers.silu_mul(gu)
    if m is None:
        gate, up = gu.chunk(2, dim=-1)
        m = F.silu(gate) * up
    return m


class RopeTable:
    """cos/sin ``[B, n, 1, D]`` at given positions, looked up in tables that a HF rotary module
    computes once (so every static RoPE variant and its scaling match HF exactly: each entry is
    the same outer-product element HF computes per step); grown by doubling, remade for another
    dtype or device."""

    def __init__(self, rotary):
        self.rotary = rotary
        self._key, self._len = None, 0

    def __call__(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``like``: a tensor of the dtype and device the tables are for (the rotary module's input)."""
        self._ensure(int(positions.max()) + 1, like)
        return self._cos[positions].unsqueeze(2), self._sin[positions].unsqueeze(2)

    def span(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, D]`` of the positions ``start .. start + n - 1`` (contiguous views of the tables;
        no tensor op: a drafting step asks every step)."""
        self._ensure(start + max(n, 1), like)
        return self._cos[start:start + n], self._sin[start:start + n]

    def _ensure(self, need: int, like: torch.Tensor) -> None:
        """Tables covering positions ``< need`` for ``like``'s dtype and device."""
        key = (like.dtype, like.device)
        if need > self._len or key != self._key:
            size = max(need, 2 * self._len if key == self._key else 0, 1024)
            pos = torch.arange(size, device=like.device).view(1, -1)
            with torch.inference_mode(False), torch.no_grad():  # plain tensors, usable outside inference mode
                tables = [self.rotary(like.detach().reshape(-1)[:1].view(1, 1, 1), pos) for _ in range(2)]
                # until two agree: a worker thread's first MKL VML cos can run a low-accuracy kernel for
                # its chunk (runtime/mkl_warmup.py); a one-bf16-step odd entry changes a process's text
                while not all(torch.equal(a, b) for a, b in zip(*tables[-2:])) and len(tables) < 5:
                    tables.append(self.rotary(like.detach().reshape(-1)[:1].view(1, 1, 1), pos))
            cos, sin = tables[-1]
            self._cos, self._sin, self._len, self._key = cos[0], sin[0], size, key


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


#: row counts up to this run as they are in oneDNN's packed linear; above, see :func:`row_bucket`
ROW_EXACT = 32


def row_bucket(rows: int) -> int:
    """The row count a packed oneDNN product of ``rows`` rows runs with: ``rows`` up to
    :data:`ROW_EXACT`, else rounded up to one of 8 sizes per octave (33 -> 36, 100 -> 104,
    513 -> 576: at most 1/8 more rows).

    Why: oneDNN keeps a primitive per row count and ideep its descriptor, ~250-400 kB per shape in
    two 1024-entry caches (measured: 1,200 new shapes +451 MB in use, never returned). A server's
    steps (decode rows plus prefill chunks) take hundreds of row counts per weight, so its memory
    rose for hours as rarer counts came up. Bucketed, each weight has ~70 shapes up to 1,024 rows;
    the padded rows cost at most 1/8 more compute on steps above 32 rows."""
    if rows <= ROW_EXACT:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _onednn(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x2 = torch.cat([x2, x2.new_zeros(padded - rows, x2.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, b, "none", [], "")
    return y[:rows].view(*x.shape[:-1], y.shape[-1])


def _gemv_t(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x @ wt
    return y if b is None else y + b


def _avx512bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, keep: bool = False,
                fma2: bool = False) -> torch.Tensor:
    # bf16 products only; a head kept in another dtype that reuses the target's choice gets ATen's
    if x.dtype == w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0:
        return cpu_gemv.gemv_bf16(x, w, b, keep=keep, fma2=fma2)
    return F.linear(x, w, b)


def _fp32(x: torch.Tensor, w32: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    # bf16 activations and weights widen exactly; the sums are MKL's fp32 GEMM's, rounded back to x's dtype
    return F.linear(x.float(), w32, None if b is None else b.float()).to(x.dtype)


# name -> (prepare a weight [out, in] once, apply(x, prepared, bias)); "aten" keeps the HF tensor
KERNELS = {
    "aten": (lambda w: w, F.linear),
    "gemv_t": (lambda w: w.t().contiguous(), _gemv_t),  # [in, out] rows: one-row products only
    "onednn": (_onednn_pack, _onednn),  # oneDNN's packed (blocked) weight layout
    # AVX2 few-row products (runtime/cpu_gemv.py): up to cpu_gemv.MAX_ROWS rows, the HF tensor itself
    "avx2": (lambda w: w.contiguous(), cpu_gemv.gemv),
    # AVX-512 BF16 few-row products (runtime/cpu_gemv.py gemv_bf16): bf16 weights only
    "avx512bf16": (lambda w: w.contiguous(), _avx512bf16),
    # the same products on Intel's AMX tiles (cpu_gemv.gemv_amx): bf16 weights packed in its tile
    # layout, every target matrix's sizes multiples of 32; offered only where they all are
    "amx": (cpu_gemv.amx_pack, cpu_gemv.gemv_amx),
    # bf16 weights widened once to fp32 copies (twice their bytes), products by MKL's fp32 GEMM: a
    # many-row candidate only (prefill, batched generation), where bf16's own GEMMs run on vdpbf16ps at
    # half a zmm FMA's rate (an Intel Xeon without AMX: 64 rows 1.5x faster, forty-first session)
    "fp32": (lambda w: w.float().contiguous(), _fp32),
}

#: environment variable naming the layer kernel's products (``avx512bf16``, ``amx``) instead of the
#: engine's measured choice (``auto``, the default)
KERNELS_ENV = "SPECFOUNDRY_KERNELS"

#: bytes of weights the kernel choice streams per measured call (LlamaEngine._choose_kernels)
MEASURE_BYTES = 128 << 20

#: kernels made for a few rows: more than cpu_gemv.MAX_ROWS go to the many-row kernel (kernel_for)
FEW_ROW = ("avx2", "avx512bf16", "amx")

#: the fewest rows the many-row kernel "fp32" takes (kernel_for): its copies are twice the bf16 bytes, and a
#: forward's matrices streamed at 9-48 rows ran 1.2-4x slower on them than in the few-row kernel's passes of 8
#: (a Xeon without AMX, forty-first session); below this a tree verifies on a plain step's products
FP32_ROWS = 64

#: kernels the layer kernel (cpu_layers.run_layers) runs a step's products on
LAYER_KERNELS = ("avx512bf16", "amx")


def kernel_for(kernels: tuple[str, ...], rows: int) -> str:
    """The kernel of ``kernels`` (one-row, several-row[, many-row]) for a product of ``rows`` rows: the
    several-row kernel, except that a few-row kernel (:data:`FEW_ROW`) hands more than ``cpu_gemv.MAX_ROWS``
    rows (prefill, batched generation, large trees) to the many-row kernel: the third entry (the
    engine's choice at 32 and 128 rows; fp32 copies from :data:`FP32_ROWS` rows only), else oneDNN where that
    is prepared, else ATen. AMX keeps up to
    ``cpu_gemv.AMX_ROWS`` rows (one pass over the weights for them all): a tree of that many nodes is verified
    on the plain steps' products, bit for bit, and in the layer kernel's one call."""
    if rows == 1:
        return kernels[0]
    if kernels[1] not in FEW_ROW or rows <= (cpu_gemv.AMX_ROWS if kernels[1] == "amx" else cpu_gemv.MAX_ROWS):
        return kernels[1]
    if len(kernels) > 2:
        return kernels[1] if kernels[2] == "fp32" and rows < FP32_ROWS else kernels[2]
    return "onednn" if "onednn" in kernels else "aten"


def head_kernels(kernels: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels a speculator head runs its products on when its target's engine chose ``kernels``:
    the same, except AVX-512 BF16 for AMX on one and several rows (a head's weights are read from the
    caches every step, where those products need no tile packing). Many rows (a head's pass over a
    prompt) keep AMX: there the few-row kernel re-reads the weights per 8 rows (700 prompt pairs 85 ms,
    on the tiles 27, oneDNN 30 at 2 threads on a Xeon with AMX, thirty-sixth session)."""
    return tuple("avx512bf16" if k == "amx" and i < 2 else k for i, k in enumerate(kernels))


def kernels_used(kernels: tuple[str, ...]) -> set[str]:
    """Every kernel :func:`kernel_for` can pick from ``kernels`` (what to prepare weights for)."""
    return set(kernels) | {kernel_for(kernels, max(cpu_gemv.MAX_ROWS, cpu_gemv.AMX_ROWS) + 1)}


#: a speculator head's few-row products with int8 weights (cpu_gemv.gemv_q8): a head's own, never a target's
_HEAD_KERNELS = {**KERNELS, "q8": (cpu_gemv.q8_pack, cpu_gemv.gemv_q8)}


class PreparedLinears:
    """Runs ``nn.Linear`` modules through the engine's kernels (one-row / several-row choice),
    keeping a kernel-prepared copy of each weight that is remade when the weight changes
    (pointer, dtype or in-place version). Used by the speculator heads' drafting steps.
    :meth:`fused` runs several linears of one input as one product (Q/K/V, gate/up), as the
    target's fused matrices do: one kernel call instead of three costs ~60 us less per head step.
    ``int8``: the AVX-512 BF16 few-row products run on int8 copies of the weights instead
    (``"q8"``, :func:`.cpu_gemv.gemv_q8`; inputs a multiple of 32): half the bytes a drafting step
    reads, where it is bound by them; the drafts change a little, never what is accepted
    (the verifier judges whatever is drafted)."""

    def __init__(self, kernels: tuple[str, str], int8: bool = False):
        # a head's weights are read from the caches every step, where the AVX-512 BF16 products
        # (no tile packing, no prefetch) serve; the target's AMX choice says the CPU has them
        self.kernels = head_kernels(kernels)
        self.int8 = bool(int8) and "avx512bf16" in kernels_used(self.kernels)
        self._prepared: dict = {}

    @staticmethod
    def _stamp(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), w.dtype, 0 if w.is_inference() else w._version)

    def __call__(self, lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.fused((lin,), x)

    def prepare(self, lins: tuple[torch.nn.Linear, ...]) -> None:
        """Prepare ``lins`` (one linear, or a group :meth:`fused` runs) for both kernels now, so a
        first step does not pay for it (a weight edited later is re-prepared when next used)."""
        for kernel in kernels_used(self.kernels):
            self._entry(lins, self._takes(lins, kernel))

    def _takes(self, lins: tuple[torch.nn.Linear, ...], kernel: str) -> str:
        """``kernel``, or AVX-512 BF16 where it is AMX and a weight's sizes are not multiples of 32 (the
        target's matrices are, where its engine offers AMX; a head's need not be); with ``int8``, the
        int8 products for AVX-512 BF16 ones whose inputs are a multiple of 32."""
        if kernel == "amx" and not all(cpu_gemv.amx_supports(lin.weight) for lin in lins):
            kernel = "avx512bf16"
        if kernel == "avx512bf16" and self.int8 and lins[0].in_features % 32 == 0 \
                and all(lin.weight.dtype == torch.bfloat16 for lin in lins):
            return "q8"
        return kernel

    def fused(self, lins: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """``cat([lin(x) for lin in lins], -1)`` as one product over the concatenated weights."""
        kernel = self._takes(lins, kernel_for(self.kernels, x.numel() // x.shape[-1]))
        hit = self._entry(lins, kernel)
        if kernel == "avx512bf16":  # a head's weights, read every step from the caches: no prefetch ahead
            return _avx512bf16(x, hit[0], hit[2], keep=True)
        if kernel == "q8":
            return cpu_gemv.gemv_q8(x, hit[0], hit[2], keep=True)
        return KERNELS[kernel][1](x, hit[0], hit[2])

    def _entry(self, lins: tuple[torch.nn.Linear, ...], kernel: str) -> tuple:
        """(prepared weight, stamp, bias) of ``lins`` for ``kernel``, remade when a weight changed."""
        if kernel == "aten" and len(lins) == 1:
            return (lins[0].weight, None, lins[0].bias)
        stamp = tuple(self._stamp(t) for lin in lins for t in (lin.weight, lin.bias) if t is not None)
        key = (tuple(id(lin) for lin in lins), kernel)
        hit = self._prepared.get(key)
        if hit is None or hit[1] != stamp:
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([lin.weight.detach() for lin in lins])
                biases = [lin.bias for lin in lins]
                b = None if all(v is None for v in biases) else torch.cat(
                    [w.new_zeros(lin.out_features) if v is None else v.detach() for v, lin in zip(biases, lins)])
                hit = self._prepared[key] = (_HEAD_KERNELS[kernel][0](w), stamp, b)
        return hit


class LlamaEngine:
    """The fused weights and the forward of one Llama-family model (see the module docstring)."""

    def __init__(self, model, kernels: str | tuple[str, str] = "auto"):
        # built as ordinary tensors even when first needed inside an inference_mode block
        with torch.inference_mode(False), torch.no_grad():
            self._build(model, kernels)

    def _build(self, model, kernels) -> None:
        reason = engine_support(model)
        if reason is not None:
            raise ValueError(f"the engine cannot run this model: {reason}")
        c = model.config
        inner = model.model
        self.config = c
        self.num_layers = c.num_hidden_layers
        self.hq = c.num_attention_heads
        self.hkv = getattr(c, "num_key_value_heads", None) or self.hq
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.hq
        self.groups = self.hq // self.hkv
        self.eps = float(c.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        # the matrices a step streams go into one huge-page arena where that helps (hugepages.py)
        self._arena = self._new_arena(model)
        self.huge_pages = self._arena is not None and self._arena.advised
        tied = model.get_output_embeddings().weight is inner.embed_tokens.weight
        head = self._moved(model.get_output_embeddings())
        if tied:
            inner.embed_tokens.weight = head
        self.embed = inner.embed_tokens.weight
        self.source = (self.embed.data_ptr(), self.embed.dtype, self.embed.device)  # what it was built from
        self.final_norm = inner.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.head = {"lm_head": self.lm_head}
        self.rotary = inner.rotary_emb
        self.layers = [self._fuse(layer) for layer in inner.layers]
        self._arena = None  # (the tensors taken from it keep its memory)
        self._rope = RopeTable(self.rotary)
        self.masks = MaskBuffer(self.groups, self.device)
        # decode and verification steps of one sequence in one C call where it runs (cpu_layers);
        # False keeps the op-by-op forward (A/B measurements, tests)
        self.use_layer_kernel = True
        self.prefill_kernel = True  # a prompt's prefill on cpu_attention.prefill_attention; False: SDPA (A/B)
        self.fma2 = False  # the 2-row passes over streamed weights on the FMA path (_two_rows_on_fma)
        self.version = self.weights_version()
        if kernels != "auto":
            self.kernels, self.kernels_from = tuple(kernels), "given"
            self._prepare(self.kernels)
            return
        # (one-row kernel, several-row kernel[, many-row kernel]): measured on this machine, the first
        # time only (runtime/choices.py: kernels whose sums differ in the last bits swapped places
        # between processes, and with them a prompt's outputs)
        parts = self._choice_parts()
        products, self.kernels_from = self._kept_kernels("engine-products", parts, self._choose_kernels)
        self.kernels = products
        self._prepare(products)
        forced = os.environ.get(KERNELS_ENV, "auto")
        options = self.layer_kernel_options() if forced != "auto" else []
        if options:
            self.kernels = self._forced(forced, options)
            return
        # (a model the layer kernel does not run, e.g. the float32 copy that `auto` dtype times, keeps
        # the timed choice: the variable names the layer kernel's products)
        best, self.kernels_from = self._kept_kernels("engine-kernels", {**parts, "products": products},
                                                     lambda: self._prefer_layer_kernel(products))
        self._prepare(best)
        self._drop_unused(best)
        self.kernels = best
        self.fma2 = self._two_rows_on_fma(parts)

    def _two_rows_on_fma(self, parts: dict) -> bool:
        """Whether the layer kernel's products and the LM head take their passes of 2 rows over this
        model's streamed weights on the FMA path (the same bits: only where :func:`.cpu_gemv.fma_exact`).
        On a 2-core AMD EPYC (Zen 4) vdpbf16ps streams 1 and 3-5 rows of SmolLM2-135M's matrices at
        about one row's pace but 2 rows ~1.2x slower at 1 thread: a 2-token forward cost 1.29x a 1-token
        one, ~1.0-1.05x with the 2-row passes on FMAs (the LM head 2.7 -> 2.1 ms); at 2 threads the two
        tie; in cache vdpbf16ps is faster at every row count, so the drafting heads' products keep it
        (docs/results.md, fifty-first session). A 2-token step is a chain of one draft, a serving step
        of two requests' tokens, the adaptive controller's smallest shape. Measured on this model's own
        forwards once per machine, thread count and kernel set, then kept (:meth:`_kept`)."""
        if self.device.type != "cpu" or self.kernels[1] != "avx512bf16" or not cpu_gemv.fma_exact() \
                or 2 in cpu_gemv.fma_rows() or self._layer_table(1, 2, None, self.new_cache(capacity=8).kv) is None:
            return False  # (a layer kernel that does not run here, or runs every 2-row pass on FMAs already)
        value, _ = self._kept("engine-fma2", {**parts, "kernels": list(self.kernels)}, self._measure_two_rows,
                              lambda v: isinstance(v, bool))
        return value

    def _measure_two_rows(self) -> bool:
        """Whether a 2-token forward after 64 cached tokens is faster (by more than 3%) with the 2-row passes
        on the FMA path: the best of 8 rounds alternating the paths (a machine slowing down slows both)."""
        gen = torch.Generator().manual_seed(0)
        cache = self.new_cache(capacity=72)
        best = {False: float("inf"), True: float("inf")}
        with torch.inference_mode():
            self.forward(torch.randint(0, self.embed.shape[0], (1, 64), generator=gen), cache, torch.arange(64).view(1, 64))
            cache.commit()
            ids = torch.randint(0, self.embed.shape[0], (1, 2), generator=gen)
            pos = (64 + torch.arange(2)).view(1, 2)

            def once():
                self.forward(ids, cache, pos)
                cache.rollback()

            try:
                for r in range(8):
                    for on in best:
                        self.fma2 = on
                        best[on] = min(best[on], best_seconds(once, 2, self.device, warm=r == 0))
            finally:
                self.fma2 = False
        return best[True] < 0.97 * best[False]

    def _kept(self, kind: str, parts: dict, measure, valid) -> tuple:
        """``(measure(), "measured")``, or the value kept on this machine for ``parts`` (:func:`.choices.kept`;
        off CPU nothing is kept: always measured there)."""
        if self.device.type != "cpu":
            return measure(), "measured"
        return choices.kept(kind, parts, measure, valid)

    def _kept_kernels(self, kind: str, parts: dict, measure) -> tuple[tuple[str, ...], str]:
        """:meth:`_kept` for a kernel tuple."""
        value, where = self._kept(kind, parts, lambda: list(measure()),
                                  lambda v: isinstance(v, list) and 2 <= len(v) <= 3 and all(k in KERNELS for k in v))
        return tuple(value), where

    def _choice_parts(self) -> dict:
        """What the engine's kernel choice depends on besides the machine (:func:`.choices.choice_path`):
        the model's matrices, dtype, thread count, the kernels offered here and their sources."""
        shapes = sorted({tuple(m.shape) for m in self._matrices()})
        return {"dtype": str(self.dtype), "threads": torch.get_num_threads(), "layers": self.num_layers,
                "huge_pages": self.huge_pages,
                "matrices": [list(s) for s in shapes], "sources": _kernel_sources(),
                "offered": {"avx2": cpu_gemv.available(), "avx512bf16": cpu_gemv.bf16_available(),
                            "amx": self._amx_usable(), "onednn": torch.backends.mkldnn.is_available(),
                            "fp32": self._fp32_bulk_fits()}}

    def _forced(self, name: str, layer_options: list[tuple[str, ...]]) -> tuple[str, ...]:
        """The product set of ``layer_options`` (:meth:`layer_kernel_options`) named by :data:`KERNELS_ENV`
        (the engine's own choice weighs a 1-token and a 4-token forward alike, so it can keep the products
        a plain step prefers where a deployment that always speculates would rather have the cheaper
        verification: AMX on an Intel Xeon, docs/results.md thirty-third session)."""
        options = {o[0]: o for o in layer_options}
        if name not in options:
            raise ValueError(f"{KERNELS_ENV}={name!r}: the layer kernel runs this model here on "
                             f"{', '.join(options)} (or 'auto')")
        self._prepare(options[name])
        self._drop_unused(options[name])
        return options[name]

    def _prepare(self, kernels: tuple[str, ...]) -> None:
        for name in kernels_used(kernels):
            if name not in KERNELS:
                raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
            prepare = KERNELS[name][0]
            for w in self._matrix_holders():
                for key in _MATRICES:
                    if key in w and f"{key}@{name}" not in w:
                        w[f"{key}@{name}"] = prepare(w[key])

    def layer_kernel_options(self, chosen: tuple[str, ...] | None = None) -> list[tuple[str, ...]]:
        """The product sets the layer kernel (:mod:`.cpu_layers`) can run this model's decode and
        verification forwards on here: AVX-512 BF16, and AMX where its tiles run every matrix
        (:meth:`_amx_usable`), each as both the one-row and the several-row kernel (AMX's sums differ
        from the other kernels' in the last bits: one-row and several-row steps on different ones would
        make a verified token's logits differ from a plain step's) with ``chosen``'s (default: the
        engine's) many-row kernel; [] where the layer kernel does not run this model."""
        chosen = self.kernels if chosen is None else chosen
        bulk = chosen[2] if len(chosen) > 2 else ("onednn" if "onednn" in chosen else "aten")
        if self.device.type != "cpu" or self.layers[0]["q_norm"] is not None \
                or not cpu_gemv.bf16_available() or not all(cpu_gemv.bf16_supports(w[k]) for w in self.layers
                                                             for k in _MATRICES if k in w) \
                or not cpu_layers.supports(self.embed.shape[1], self.layers[0]["w_down"].shape[1], self.head_dim,
                                           self.dtype, 1):
            return []
        return [(k, k, bulk) for k in LAYER_KERNELS if k == "avx512bf16" or self._amx_usable()]

    @contextlib.contextmanager
    def using_kernels(self, kernels: tuple[str, ...]):
        """Run the engine's forwards on ``kernels`` inside the block (their weights prepared first and
        kept), then go back to the chosen ones: how a benchmark runs plain decoding on the products
        that decode fastest while the speculative methods keep the engine's choice."""
        self._prepare(kernels)
        was, self.kernels = self.kernels, tuple(kernels)
        try:
            yield self
        finally:
            self.kernels = was

    def _prefer_layer_kernel(self, chosen: tuple[str, ...]) -> tuple[str, ...]:
        """The matrix kernels measured alone, or the AVX-512 BF16 products where the layer kernel
        (:mod:`.cpu_layers`, which runs on them) makes whole decode and verification forwards faster:
        its one C call saves the ~4,700 ops between the products (1.3-1.5x per forward on an EPYC,
        docs/results.md, twenty-third session), which a comparison of the products alone does not see,
        and a noisy product measurement picked another kernel here once."""
        # the layer kernel's product sets (AVX-512 BF16; the AMX tiles where they run here: their
        # few-row products measured alone at 1 row about as fast, at 4-8 rows 1.1-1.4x faster, the
        # tiles doing 16 rows' work per weight load) and what the products alone chose
        options = self.layer_kernel_options(chosen)
        if not options:
            return chosen
        if chosen[:2] not in [o[:2] for o in options] and ("amx" not in chosen[:2] or chosen[0] == chosen[1]):
            options.append(chosen)
        best = options[0]
        for other in options[1:]:
            self._prepare(best)
            self._prepare(other)
            with torch.inference_mode():
                ours, theirs = self._forward_seconds(best, other)
            best = best if ours < theirs else other
        self._drop_unused(best)
        return best

    def _matrices(self) -> list[torch.Tensor]:
        """Every target matrix (the layers' and the LM head), as the model holds it."""
        return [w[k] for w in self._matrix_holders() for k in _MATRICES if k in w]

    def _amx_usable(self) -> bool:
        """Whether every target matrix can run on the AMX kernel, the layer kernel's AMX build loads, and
        the packed copies (made to time it: as many bytes as the matrices) fit well in free memory."""
        mats = self._matrices()
        free = native.available_memory()
        return self.dtype == torch.bfloat16 and cpu_gemv.amx_available() and all(map(cpu_gemv.amx_supports, mats)) \
            and (free is None or 2 * sum(m.numel() * m.element_size() for m in mats) < free) \
            and cpu_layers.available(amx=True)

    def _drop_unused(self, kernels: tuple[str, ...]) -> None:
        """Free the prepared weights (and layer tables) of kernels a measurement tried but did not keep
        (AMX's packed copies are another ~270 MB for SmolLM2-135M)."""
        keep = kernels_used(kernels) | {"aten"}
        for w in self._matrix_holders():
            for key in [k for k in w if "@" in k and k.split("@", 1)[1] not in keep]:
                del w[key]
        tables = self.__dict__.get("_tables", {})
        for name in [k for k in tables if k not in keep]:
            del tables[name]

    def _forward_seconds(self, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[float, float]:
        """Seconds of a 1-token plus a 4-token forward after 64 cached tokens with kernels ``a`` then
        ``b`` (prepared; best of three rounds, alternating, so a machine slowing down slows both)."""
        gen = torch.Generator().manual_seed(0)
        cache = self.new_cache(capacity=72)
        best = {a: [float("inf")] * 2, b: [float("inf")] * 2}
        was = self.kernels
        for r in range(4):
            for kernels in (a, b):
                self.kernels = kernels
                if r == 0 and kernels == a:  # the cached context, once (many-row products: either choice's)
                    self.forward(torch.randint(0, self.embed.shape[0], (1, 64), generator=gen), cache,
                                 torch.arange(64).view(1, 64))
                    cache.commit()
                for j, n in enumerate((1, 4)):
                    ids = torch.randint(0, self.embed.shape[0], (1, n), generator=gen)
                    pos = (64 + torch.arange(n)).view(1, n)

                    def once():
                        self.forward(ids, cache, pos)
                        cache.rollback()

                    secs = best_seconds(once, 1, self.device, warm=False)
                    if r:  # the first round warms both up
                        best[kernels][j] = min(best[kernels][j], secs)
        self.kernels = was
        return sum(best[a]), sum(best[b])

    def weights_version(self) -> int:
        """Sum of the source matrices' in-place version counters: an edit of a weight after the
        prepared (packed/transposed) copies were made changes it. (Checked before every forward: the
        matrices that have a counter are listed once, ~0.13 -> ~0.02 ms per step.)"""
        tracked = self.__dict__.get("_tracked")
        if tracked is None:  # inference tensors have no counter (and stay inference tensors)
            tracked = self._tracked = [w[k] for w in self._matrix_holders() for k in _MATRICES
                                       if k in w and not w[k].is_inference()]
        return sum(map(_VERSION, tracked))  # the counters read in C: ~100 us -> a few per step, cold

    def _new_arena(self, model) -> hugepages.Arena | None:
        """A huge-page arena (:mod:`.hugepages`) with room for the matrices a decode step streams, as
        :meth:`_fuse` lays them out, and the LM head; None where it does not apply (not a CPU, huge
        pages off, mixed dtypes) or the allocation fails."""
        shapes, dtypes = [], set()
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            for group in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)):
                shapes.append((sum(lin.weight.shape[0] for lin in group), group[0].weight.shape[1]))
                dtypes |= {lin.weight.dtype for lin in group}
        head = model.get_output_embeddings().weight
        shapes.append(tuple(head.shape))
        dtypes.add(head.dtype)
        if head.device.type != "cpu" or len(dtypes) != 1 or not hugepages.wanted():
            return None
        try:
            return hugepages.Arena(shapes, head.dtype)
        except (RuntimeError, MemoryError):
            return None

    def _moved(self, lin) -> torch.Tensor:
        """``lin.weight``, moved into the arena (the module re-pointed at the new tensor) where there is one."""
        w = lin.weight
        if self._arena is None:
            return w
        with torch.no_grad():
            dest = self._arena.take(tuple(w.shape)).copy_(w.detach())
        lin.weight = torch.nn.Parameter(dest, requires_grad=w.requires_grad)
        return lin.weight

    def _fused(self, linears, attr: str) -> torch.Tensor | None:
        """Concatenate the linears' ``attr`` (weight or bias) row-wise and point each module at its
        slice of the result, so the fused tensor is the only copy in memory (weights: in the arena
        where there is one)."""
        parts = [getattr(lin, attr) for lin in linears]
        if any(p is None for p in parts):
            return None
        with torch.no_grad():
            if attr == "weight" and self._arena is not None:
                out = self._arena.take((sum(p.shape[0] for p in parts), parts[0].shape[1]))
                fused = torch.cat([p.detach() for p in parts], out=out)
            else:
                fused = torch.cat([p.detach() for p in parts]).contiguous()
        row = 0
        for lin, p in zip(linears, parts):
            setattr(lin, attr, torch.nn.Parameter(fused[row: row + p.shape[0]], requires_grad=False))
            row += p.shape[0]
        return fused

    def _fuse(self, layer) -> dict:
        a, mlp = layer.self_attn, layer.mlp
        qkv = (a.q_proj, a.k_proj, a.v_proj)
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return {
            "ln1": layer.input_layernorm.weight, "wqkv": self._fused(qkv, "weight"), "bqkv": self._fused(qkv, "bias"),
            "wo": self._moved(a.o_proj), "ln2": layer.post_attention_layernorm.weight,
            "w_gu": self._fused((mlp.gate_proj, mlp.up_proj), "weight"), "w_down": self._moved(mlp.down_proj),
            "q_norm": None if q_norm is None else q_norm.weight, "k_norm": None if k_norm is None else k_norm.weight,
        }

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def _matrix_holders(self) -> list[dict]:
        return self.layers + [self.head]

    @torch.inference_mode()
    def _choose_kernels(self) -> tuple[str, ...]:
        """The fastest kernel for one-row (plain steps) and for 2-8-row products (verification), and
        when that is a few-row kernel (``avx2``, ``avx512bf16``), the fastest at 32 and 128 rows for
        more rows than it takes.

        Measured once on the LM head and the layers' matrices up to :data:`MEASURE_BYTES` (best of two
        rounds over the candidates; several rows at 2, 4 and 8 rows, summed). On the
        CPUs measured here (AMD EPYC, MKL + oneDNN in the torch wheel) oneDNN's packed weights run
        4-16 rows 1.5-2x faster than ``F.linear`` and bf16 one-row products 1.4x faster;
        fp32 one-row products are fastest against transposed weights (see docs/results.md).
        Off CPU the ATen kernels (cuBLAS) are used.
        """
        if self.device.type != "cpu":
            return ("aten", "aten")
        # the LM head and layers' matrices up to MEASURE_BYTES: weights streamed from memory, as in a
        # decode step (on the head and one layer alone, the layer's matrices stayed in cache and a
        # kernel faster on cached weights won where it was 1.2x slower in decoding)
        mats = [self.lm_head]
        for layer in self.layers:
            if len(mats) > 1 and sum(m.numel() * m.element_size() for m in mats) >= MEASURE_BYTES:
                break
            mats += [layer[k] for k in _MATRICES if k in layer]
        candidates = {"aten": mats, "gemv_t": [KERNELS["gemv_t"][0](m) for m in mats]}
        if cpu_gemv.available() and all(cpu_gemv.supports(m) for m in mats):
            candidates["avx2"] = mats
        if cpu_gemv.bf16_available() and all(cpu_gemv.bf16_supports(m) for m in mats):
            candidates["avx512bf16"] = mats
        if self._amx_usable():
            candidates["amx"] = [cpu_gemv.amx_pack(m) for m in mats]
        try:
            candidates["onednn"] = [_onednn_pack(m) for m in mats]
            _onednn(torch.zeros(1, mats[0].shape[1], dtype=self.dtype), candidates["onednn"][0])
        except (RuntimeError, AttributeError):  # a torch build without oneDNN
            candidates.pop("onednn", None)

        def cost(name: str, rows: int) -> float:
            if name == "fp32" and rows < FP32_ROWS:
                # what runs there when fp32 is the many-row kernel (kernel_for): timing its copies at 32 rows,
                # where they never run, made the choice a coin toss (a Xeon without AMX: 32 + 128 rows
                # fp32 130 ms, AVX-512 BF16 142, oneDNN 144; as they run, fp32 118; forty-seventh session)
                name = several
            apply = KERNELS[name][1]
            xs = [torch.randn(rows, m.shape[1], dtype=self.dtype) for m in mats]
            return best_seconds(lambda: [apply(x, p) for x, p in zip(xs, candidates[name])], 1, warm=False)

        def best_of(names: list[str], sizes: tuple[int, ...], warm: bool = False) -> tuple[str, dict]:
            # three rounds over the candidates in turn (a machine that slows mid-measurement slows them
            # all; the first round also pays any lazy set-up; a third since the choice is kept per machine,
            # runtime/choices.py), each one's best per size, summed over the
            # sizes; after the first round only those within 2x of the best go on. warm: an untimed
            # pass first (MKL's and oneDNN's first GEMMs of a shape cost a set-up that made the first
            # round drop the fastest many-row kernel, or pick another, on three loads in a row here)
            for k in names if warm else ():
                for r in sizes:
                    cost(k, r)
            best = {(k, r): float("inf") for k in names for r in sizes}
            for _ in range(3):
                for k in names:
                    for r in sizes:
                        best[(k, r)] = min(best[(k, r)], cost(k, r))
                total = {k: sum(best[(k, r)] for r in sizes) for k in names}
                names = [k for k in names if total[k] <= 2 * min(total.values())]
            return min(names, key=total.get), {k: total[k] for k in names}

        one, _ = best_of(list(candidates), (1,))
        # verification sizes: chains of 1-3, small trees and lookup chains (4-8 nodes); at one size
        # alone two kernels within a few percent swapped places between runs (a mis-pick cost 1.3x at
        # 3 rows on an EPYC with avx512_bf16)
        several, costs = best_of([k for k in candidates if k != "gemv_t"], (2, 4, 8))
        if "amx" in (one, several) and one != several:
            # AMX's sums differ from every other kernel's in the last bits: one-row and several-row
            # products on different ones would make a verified token's logits differ from a plain
            # step's; its one-row products measured as fast as AVX-512 BF16's, so it takes both or neither
            one = "amx" if several == "amx" else best_of([k for k in candidates if k != "amx"], (1,))[0]
        if several not in FEW_ROW:
            return (one, several)
        # products of more rows than a few-row kernel takes in one pass (prefill, batched generation, big trees;
        # with AMX only past cpu_gemv.AMX_ROWS, see kernel_for):
        # the fastest at 32 and 128 rows (batched serving steps, prefill chunks), the few-row kernel
        # included (it then runs them MAX_ROWS at a time; with ATen's emulated bf16 as the alternative
        # avx2 was 4x faster here); at 32 rows alone avx512bf16 and oneDNN were within the noise of two
        # rounds, and the mis-pick cost 1.3-1.7x on prefill
        # (oneDNN always among them: it can fall out of the few-row round, within 2x of it at 2-8 rows)
        bulk = [k for k in candidates if k in costs or k == "onednn"]
        if self._fp32_bulk_fits():
            candidates["fp32"] = [KERNELS["fp32"][0](m) for m in mats]
            bulk.append("fp32")
        return (one, several, best_of(bulk, (32, 128), warm=True)[0])

    def _fp32_bulk_fits(self) -> bool:
        """Whether the many-row products may take fp32 copies of a bf16 model's matrices (:data:`KERNELS`
        ``"fp32"``): twice the matrices' bytes, offered only where that is under a quarter of free memory."""
        if self.dtype != torch.bfloat16:
            return False
        free = native.available_memory()
        size = sum(m.numel() * 4 for m in self._matrices())
        return free is not None and 4 * size < free

    def new_cache(self, batch: int = 1, capacity: int = 1024) -> StaticKVCache:
        return StaticKVCache(self.num_layers, self.hkv, self.head_dim, batch=batch, capacity=capacity,
                             dtype=self.dtype, device=self.device)

    # -- preallocated tables -------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B, n, 1, D]`` at ``positions`` (see :class:`RopeTable`)."""
        return self._rope(positions, self.embed)

    # -- the forward ---------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w, self.eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: StaticKVCache, position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                logits_for: torch.Tensor | None = None) -> TargetOutput:
        """Same contract as :meth:`TargetModel.forward` (``position_ids`` None: ``cache.length +
        arange(n)``, read from the RoPE tables as one slice: no tensor op)."""
        cache.check_ready()
        B, n = input_ids.shape
        if B != cache.batch:
            if cache.length or cache._pending:
                raise ValueError(f"input batch {B} != cache batch {cache.batch}")
            cache.rebatch(B)  # an empty cache takes the batch of its first forward
        cache.reserve(n)
        past = cache.length
        if position_ids is None:
            cos, sin = self._rope.span(past, n, self.embed)  # [n, D] -> [B, n, 1, D] views
            cos, sin = cos[None, :, None].expand(B, n, 1, -1), sin[None, :, None].expand(B, n, 1, -1)
        else:
            cos, sin = self.rope(position_ids.to(self.device))
        kv = cache.kv
        table = self._layer_table(B, n, tree_mask, kv)
        if table is not None:
            # one C call for all layers (AVX-512 BF16): no PyTorch ops between the kernels
            # K also kept transposed for the kernel's scores (2x faster at 3-5 rows over long contexts)
            keys_t = cache.transposed_keys() if isinstance(cache, StaticKVCache) else None
            x, feats = self.kernel_layers(table, input_ids, cos, sin, kv, past, tree_mask, feature_layers, keys_t)
            if keys_t is not None:
                cache.keys_transposed_to(past)
        elif (tree_mask is None or tree_mask.shape[-1] == n) and cpu_attention.decode_supports(kv[0], B, n):
            # one sequence's decode or verification step on the AVX-512 BF16 kernel: 1.6-2.6x faster
            # than SDPA here for 1-8 tokens (docs/results.md, twenty-second session); no mask to build
            x, feats = self.run_layers(input_ids, cos, sin, lambda i, q, k, v: cpu_attention.decode_attention(
                kv[i], q, k, v, past, tree_mask, self.scale), feature_layers)
        elif tree_mask is None and self.prefill_kernel and cpu_attention.prefill_supports(kv[0], B, n):
            # a prompt's prefill on the same kernel, over the causal triangle only: 2.2-2.5x SDPA's flash
            # attention here (docs/results.md, fifty-second session); from the unrotated Q/K/V in one C call
            # with the RoPE and the cache writes where the layer library is built
            fused = None
            if cpu_layers.available() and position_ids is None and cos.dtype == torch.bfloat16:
                cs, sn = cos[0, :, 0], sin[0, :, 0]  # [n, D]: rows of the RoPE tables

                def fused(i, qkv):
                    return cpu_layers.prefill_attention(kv[i], qkv, cs, sn, past, self.scale)
            x, feats = self.run_layers(input_ids, cos, sin, lambda i, q, k, v: cpu_attention.prefill_attention(
                kv[i], q, k, v, past, self.scale), feature_layers, fused)
        else:
            causal = prefill_causal(tree_mask, past, n, kv.device)  # a prefill: no mask at all
            mask = None if causal else self.masks.get(tree_mask, B, n, past)
            x, feats = self.run_layers(input_ids, cos, sin, lambda i, q, k, v: attend(
                kv[i], q, k, v, past, mask, self.scale, causal), feature_layers)
            self.masks.release(mask, n if tree_mask is None else tree_mask.shape[-1])
        cache.mark_appended(n)
        return self.finish(x, feats, feature_layers, logits_for)

    def _layer_table(self, B: int, n: int, tree_mask: torch.Tensor | None, kv: torch.Tensor) -> torch.Tensor | None:
        """The weight table of :func:`.cpu_layers.run_layers` when that runs this step (one sequence,
        bf16, up to :data:`.cpu_layers.MAX_TOKENS` tokens on the AVX-512 BF16 products or
        :data:`.cpu_layers.MAX_TOKENS_AMX` on the AMX tiles, a mask over the
        new tokens only, no per-head Q/K norms), else None."""
        kernel = kernel_for(self.kernels, n)
        if not self.use_layer_kernel or B != 1 or kernel not in LAYER_KERNELS \
                or (tree_mask is not None and tree_mask.shape[-1] != n) or self.layers[0]["q_norm"] is not None \
                or kv.stride(-1) != 1 or kv.stride(-2) != kv.shape[-1]:
            return None
        if not cpu_layers.supports(self.embed.shape[1], self.layers[0]["w_down"].shape[1], self.head_dim,
                                   self.dtype, n, amx=kernel == "amx"):
            return None
        tables = self.__dict__.setdefault("_tables", {})
        table = tables.get(kernel)
        if table is None:
            key = "@" + kernel
            table = tables[kernel] = cpu_layers.layer_table([
                {"ln1": w["ln1"], "wqkv": w["wqkv" + key], "bqkv": w["bqkv"], "wo": w["wo" + key], "ln2": w["ln2"],
                 "w_gu": w["w_gu" + key], "w_down": w["w_down" + key]} for w in self.layers])
        return table

    def kernel_layers(self, table: torch.Tensor, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv: torch.Tensor, past: int, tree_mask: torch.Tensor | None,
                      feature_layers: tuple[int, ...], keys_t: tuple[torch.Tensor, int] | None = None
                      ) -> tuple[torch.Tensor, list]:
        """:meth:`run_layers` for one sequence on the layer kernel (``table`` from :meth:`_layer_table`;
        ``kv`` ``[L, 2, 1, hkv, capacity, D]``, the new tokens written at ``past``; ``keys_t``: see
        :func:`.cpu_layers.run_layers`)."""
        return cpu_layers.run_layers(
            table, F.embedding(input_ids.to(self.device), self.embed), cos, sin, kv, past, tree_mask,
            heads=(self.hq, self.hkv), intermediate=self.layers[0]["w_down"].shape[1], eps=self.eps,
            scale=self.scale, feature_layers=feature_layers, keys_t=keys_t,
            amx=kernel_for(self.kernels, input_ids.shape[1]) == "amx", fma2=self.fma2)

    def run_layers(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention,
                   feature_layers: tuple[int, ...] = (), fused_attention=None) -> tuple[torch.Tensor, list]:
        """The decoder layers over ``input_ids`` ``[B, n]`` -> (last hidden state before the final
        norm, ``[(layer, hidden)]`` for the requested feature layers). ``attention(i, q, k, v)``
        writes layer ``i``'s new K/V wherever its cache keeps them and returns ``[B, n, hq*D]``:
        the one place the contiguous-cache forward and the serving slots' forward differ.
        ``fused_attention(i, qkv)``, where given, does the same from the unrotated ``[B, n, hq + 2 hkv, D]``
        (layers without per-head Q/K norms)."""
        B, n = input_ids.shape
        hq, hkv, D = self.hq, self.hkv, self.head_dim
        kernel = kernel_for(self.kernels, B * n)
        lin, sfx = self._streamed(kernel), "@" + kernel
        feats, want = [], set(feature_layers)
        x = F.embedding(input_ids.to(self.device), self.embed)
        for i, w in enumerate(self.layers):
            if i in want:
                feats.append((i, x))
            h = self._norm(x, w["ln1"])
            qkv = lin(h, w["wqkv" + sfx], w["bqkv"]).view(B, n, hq + 2 * hkv, D)
            if fused_attention is not None and w["q_norm"] is None:
                a = fused_attention(i, qkv)
            else:
                if w["q_norm"] is None:  # Q and K are adjacent heads: one RoPE for both
                    q, k = rotate(qkv[:, :, : hq + hkv], cos, sin).split((hq, hkv), dim=2)
                    v = qkv[:, :, hq + hkv:]
                else:  # Qwen3: per-head norms before RoPE
                    q, k, v = qkv.split((hq, hkv, hkv), dim=2)
                    q, k = rotate(self._norm(q, w["q_norm"]), cos, sin), rotate(self._norm(k, w["k_norm"]), cos, sin)
                a = attention(i, q, k, v)
            x = x + lin(a, w["wo" + sfx])
            h = self._norm(x, w["ln2"])
            x = x + lin(silu_mul(lin(h, w["w_gu" + sfx])), w["w_down" + sfx])
        return x, feats

    def finish(self, x: torch.Tensor, feats: list, feature_layers: tuple[int, ...],
               logits_for: torch.Tensor | None) -> TargetOutput:
        """Final norm, the requested features ``[B, n, F, H]`` and the LM-head rows ``logits_for``."""
        x = self._norm(x, self.final_norm)
        if self.num_layers in feature_layers:
            feats.append((self.num_layers, x))
        features = None
        if feature_layers:
            by_layer = dict(feats)
            features = torch.stack([by_layer[i] for i in feature_layers], dim=2)
        if logits_for is not None:
            x = x[:, logits_for.to(self.device)]
        head_kernel = kernel_for(self.kernels, x.shape[0] * x.shape[1])
        logits = self._streamed(head_kernel)(x, self.head["lm_head@" + head_kernel])
        return TargetOutput(logits=logits, features=features)

    def _streamed(self, kernel: str):
        """``kernel``'s product for the target's streamed weights: with the 2-row passes on the FMA path
        where the engine chose that (:meth:`_two_rows_on_fma`; a serving step of two requests' tokens)."""
        if kernel == "avx512bf16" and self.fma2:
            return functools.partial(_avx512bf16, fma2=True)
        return KERNELS[kernel][1]


class EngineTarget(TargetModel):
    """A :class:`TargetModel` whose forward and cache are the engine's (the HF model stays
    available as ``.model`` for training and for anything the engine does not cover)."""

    backend = "engine"

    def __init__(self, model, tokenizer=None, name: str | None = None):
        super().__init__(model, tokenizer, name)
        self.engine = LlamaEngine(self.model)

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> StaticKVCache:
        return self._engine().new_cache(batch, capacity or 1024)

    def cost_curve(self, sizes=(1, 2, 4, 8, 9, 16, 32, 64), past: int = 256, reps: int = 2) -> dict[int, float]:
        """Measured forward cost of ``n`` new tokens relative to one, after ``past`` tokens
        (best of ``reps``), for the adaptive controller and the serving policy; on a CPU measured once
        per machine, engine kernels and thread count and then kept (:func:`.choices.kept`, as the
        kernel choice: ~1 s saved per load, and two processes price draft shapes alike), elsewhere once
        per engine and thread count. 9 is measured because the few-row kernels (AMX's from 65
        rows) hand more than 8 rows to the many-row kernel: the products of 9 rows cost 1.2x those of 8 at 2 threads
        on a Zen 4 EPYC, a step interpolated between 8 and 16 hid (a serving step of 4 plain rows
        and one 5-token lookup chain was priced too cheap)."""
        engine = self._engine()
        curves = engine.__dict__.setdefault("curves", {})
        threads = torch.get_num_threads()
        if threads not in curves:
            def measure() -> dict[int, float]:
                gen = torch.Generator().manual_seed(0)
                cache = self.new_cache(capacity=past + max(sizes))
                self.forward(torch.randint(0, self.vocab_size, (1, past), generator=gen), cache)
                cache.commit()
                secs = {}
                for n in sizes:
                    ids = torch.randint(0, self.vocab_size, (1, n), generator=gen)

                    def once():
                        self.forward(ids, cache)
                        cache.rollback()

                    secs[n] = best_seconds(once, reps, self.device, warm=False)
                return {n: s / secs[sizes[0]] for n, s in secs.items()}

            parts = {**engine._choice_parts(), "kernels": list(engine.kernels), "sizes": list(sizes),
                     "past": past, "reps": reps}
            value, _ = engine._kept("cost-curve", parts, lambda: [[n, c] for n, c in measure().items()],
                                    lambda v: isinstance(v, list) and [p[0] for p in v] == list(sizes)
                                    and all(isinstance(p[1], (int, float)) and p[1] > 0 for p in v))
            curves[threads] = {int(n): float(c) for n, c in value}
        return dict(curves[threads])

    def _engine(self) -> LlamaEngine:
        # a .to(device/dtype) of the HF model after wrapping replaces its tensors: never use stale ones
        # and an in-place edit of a weight leaves the packed copies stale: rebuild then too
        w = self.model.get_input_embeddings().weight
        if (w.data_ptr(), w.dtype, w.device) != self.engine.source or \
                self.engine.weights_version() != self.engine.version:
            self.engine = LlamaEngine(self.model)
        return self.engine

    def forward(self, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                logits_for: torch.Tensor | None = None) -> TargetOutput:
        if not isinstance(cache, StaticKVCache):
            return super().forward(input_ids, cache, position_ids, tree_mask, feature_layers, logits_for)
        return self._engine().forward(input_ids, cache, position_ids, tree_mask, feature_layers, logits_for)
