"""Fused tree attention: one Triton kernel, its launcher, and the PyTorch reference it must match.

Scope: the ``specfoundry::TreeAttention`` op shared with the ONNX export (``export/onnx``) and the
TensorRT plugin (``export/trt/plugin.py``)::

    TreeAttention(query [B, Hq, T, D], key [B, Hkv, P+T, D], value [B, Hkv, P+T, D],
                  tree_mask int32 [B, T, ceil(T/32)], scale: float) -> out [B, Hq, T, D]

New token i attends to every past position j < P (P = key.shape[2] - T) and to new token t iff bit
(t % 32) of tree_mask[b, i, t // 32] is set (TensorRT-LLM's packed tree-mask convention). GQA: query
head h reads kv head h // (Hq / Hkv). Accumulation is fp32 whatever the I/O dtype (fp16, bf16, fp32).
A row that may attend to nothing (no past and no mask bit) yields zeros rather than NaN, in the kernel
and in the reference alike.

The kernel's parameter order is the TensorRT QDP AOT convention (input pointers, int32 scalars,
output pointers; then the constexprs); ``KERNEL_PARAMS`` names it and ``plugin.py``/``aot.py`` check
against it. Everything that would be a float or a data-dependent scalar is a constexpr (``SCALE``) or
derived from shapes (P = S - T), because a TensorRT AOT launch can only pass int32 shape expressions.

Not here: the ONNX node (export/onnx), engine building (engine.py), the GPU checks (gpu_check.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Runtime parameters of the kernel in launch order: inputs, int32 scalars, outputs. The TensorRT AOT
# plugin launches the PTX with exactly these (aot.py appends/strips Triton's trailing scratch pointers).
INPUT_PTRS = ("Q", "K", "V", "MASK")
INT_SCALARS = ("T", "S", "HQ", "HKV")
OUTPUT_PTRS = ("OUT",)
KERNEL_PARAMS = INPUT_PTRS + INT_SCALARS + OUTPUT_PTRS
CONSTEXPRS = ("SCALE", "HEAD_DIM", "BLOCK_D", "BLOCK_M", "BLOCK_N", "IEEE_DOT")

# tl.dot needs every dimension >= 16; BLOCK_M=16 suits trees of a few dozen tokens (the common case),
# BLOCK_N=32 keeps the interpreter fast; the plugin's tactics try other BLOCK_N values on the GPU.
DEFAULT_BLOCK_M = 16
DEFAULT_BLOCK_N = 32


@triton.jit
def tree_attention_kernel(
    Q, K, V, MASK,           # input pointers (contiguous): [B,HQ,T,D], [B,HKV,S,D] x2, int32 [B,T,W]
    T, S, HQ, HKV,           # int32 scalars, all shape expressions (TensorRT AOT: SymInt32 only)
    OUT,                     # output pointer [B,HQ,T,D]
    SCALE: tl.constexpr,     # softmax scale: a float cannot be an AOT runtime argument
    HEAD_DIM: tl.constexpr,  # D
    BLOCK_D: tl.constexpr,   # D rounded up to a power of two >= 16 (tl.arange / tl.dot limits)
    BLOCK_M: tl.constexpr,   # query rows per program
    BLOCK_N: tl.constexpr,   # key positions per inner step
    IEEE_DOT: tl.constexpr,  # fp32 I/O: full-precision dots (the default would be TF32 on GPUs)
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    hk = h // (HQ // HKV)
    P = S - T
    W = (T + 31) // 32

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM

    # 64-bit bases: B*H*S*D overflows int32 for long caches and large batches
    q_base = Q + (pid_bh.to(tl.int64) * T) * HEAD_DIM
    kv_off = ((b * HKV + hk).to(tl.int64) * S) * HEAD_DIM
    k_base = K + kv_off
    v_base = V + kv_off
    m_base = MASK + (b.to(tl.int64) * T) * W

    q = tl.load(q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    qk_scale = SCALE * 1.4426950408889634  # fold log2(e): the softmax runs on exp2
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: the past (every row sees every position j < P)
    for start in range(0, P, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < P
        kt = tl.load(k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE_DOT:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where(col_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # a row with nothing visible so far keeps m = -inf; shift by 0 then so exp2 gives 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Phase 2: the new tokens, visible per the packed tree mask
    for start in range(0, T, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        col_ok = offs_t < T
        words = tl.load(m_base + offs_m[:, None] * W + (offs_t // 32)[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0)
        visible = ((words >> (offs_t % 32)[None, :]) & 1) != 0
        visible = visible & col_ok[None, :]
        kt = tl.load(k_base + (P + offs_t)[None, :] * HEAD_DIM + offs_d[:, None],
                     mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE_DOT:
            qk = tl.dot(q, kt, input_precision="ieee")
        else:
            qk = tl.dot(q, kt)
        qk = tl.where(visible, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (P + offs_t)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows that saw nothing: 0 / 1 = 0
    out = acc / l_safe[:, None]
    o_base = OUT + (pid_bh.to(tl.int64) * T) * HEAD_DIM
    tl.store(o_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def block_d(head_dim: int) -> int:
    """The padded head-dim tile: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(int(head_dim)))


def constexprs(scale: float, head_dim: int, dtype: torch.dtype, *, block_m: int = DEFAULT_BLOCK_M,
               block_n: int = DEFAULT_BLOCK_N) -> dict:
    """The constexpr values for one specialisation (shared by the JIT launcher and AOT compile)."""
    return {"SCALE": float(scale), "HEAD_DIM": int(head_dim), "BLOCK_D": block_d(head_dim),
            "BLOCK_M": int(block_m), "BLOCK_N": int(block_n), "IEEE_DOT": dtype == torch.float32}


def grid(batch: int, q_heads: int, new_tokens: int, block_m: int = DEFAULT_BLOCK_M) -> tuple[int, int, int]:
    """Launch grid: (query-row blocks, batch * query heads, 1)."""
    return (triton.cdiv(new_tokens, block_m), batch * q_heads, 1)


def _check_shapes(q, k, v, packed_mask):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or packed_mask.dim() != 3:
        raise ValueError("expected q [B,Hq,T,D], k/v [B,Hkv,P+T,D], tree_mask [B,T,W]")
    B, HQ, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"key/value shape {tuple(k.shape)}/{tuple(v.shape)} does not fit query {tuple(q.shape)}")
    HKV, S = k.shape[1], k.shape[2]
    if HQ % HKV:
        raise ValueError(f"query heads {HQ} not a multiple of kv heads {HKV}")
    if S < T:
        raise ValueError(f"key length {S} shorter than the {T} new tokens")
    if tuple(packed_mask.shape) != (B, T, (T + 31) // 32) or packed_mask.dtype != torch.int32:
        raise ValueError(f"tree_mask must be int32 [{B}, {T}, {(T + 31) // 32}], got "
                         f"{packed_mask.dtype} {tuple(packed_mask.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError("query, key and value must share a dtype")
    return B, HQ, HKV, T, S, D


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_mask: torch.Tensor,
                   scale: float, *, out: torch.Tensor | None = None, block_m: int = DEFAULT_BLOCK_M,
                   block_n: int = DEFAULT_BLOCK_N, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Run the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Inputs are made contiguous (the kernel computes offsets from shapes, as the TensorRT plugin's
    LINEAR-format tensors are). ``out`` may be a preallocated contiguous [B,Hq,T,D] tensor.
    """
    B, HQ, HKV, T, S, D = _check_shapes(q, k, v, packed_mask)
    q, k, v, packed_mask = (x.contiguous() for x in (q, k, v, packed_mask))
    if out is None:
        out = torch.empty_like(q)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("out must be a contiguous tensor shaped and typed like query")
    if T == 0 or B * HQ == 0:
        return out
    meta = constexprs(scale, D, q.dtype, block_m=block_m, block_n=block_n)
    tree_attention_kernel[grid(B, HQ, T, block_m)](
        q, k, v, packed_mask, T, S, HQ, HKV, out, **meta, num_warps=num_warps, num_stages=num_stages)
    return out


# ---------------------------------------------------------------------------------------------
# Mask packing and the reference.

def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T] (row i may see new token t) -> int32 [B, T, ceil(T/32)], bit t%32 of word t//32.

    Private copy of the ONNX helper's packer (export/onnx/tree_mask.py) so this module stands alone;
    the tests check the two agree when both exist.
    """
    if mask.dim() != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"expected a bool mask [B, T, T], got {tuple(mask.shape)}")
    B, T, _ = mask.shape
    W = (T + 31) // 32
    padded = torch.zeros(B, T, W * 32, dtype=torch.int64, device=mask.device)
    padded[:, :, :T] = mask.to(torch.int64)
    weights = torch.pow(2, torch.arange(32, device=mask.device, dtype=torch.int64))
    words = (padded.view(B, T, W, 32) * weights).sum(-1)
    # two's complement into int32 (bit 31 set -> negative); explicit so no cast ever saturates
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """int32 [B, T, W] -> bool [B, T, T] (inverse of pack_tree_mask)."""
    bits = torch.arange(32, device=packed.device, dtype=torch.int64)
    words = packed.to(torch.int64) & 0xFFFFFFFF
    expanded = ((words.unsqueeze(-1) >> bits) & 1).bool()  # [B, T, W, 32]
    return expanded.flatten(-2)[..., :new_tokens]


def reference_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed_mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Plain PyTorch semantics of the op in fp32 (output in q's dtype); the kernel's ground truth."""
    B, HQ, HKV, T, S, D = _check_shapes(q, k, v, packed_mask)
    P = S - T
    group = HQ // HKV
    qf, kf, vf = (x.float() for x in (q, k, v))
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    tree = unpack_tree_mask(packed_mask, T)  # [B, T, T]
    allowed = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=q.device), tree], dim=-1)
    scores = torch.einsum("bhtd,bhsd->bhts", qf, kf) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a fully masked row -> zeros (matches the kernel)
    return torch.einsum("bhts,bhsd->bhtd", probs, vf).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Test cases shared by the CPU interpreter tests and the GPU check.

def random_tree_mask(batch: int, new_tokens: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random tree over T tokens (token 0 the root; each other token's parent an earlier token),
    as the bool [B, T, T] ancestor-or-self mask tree verification uses."""
    mask = torch.zeros(batch, new_tokens, new_tokens, dtype=torch.bool)
    for b in range(batch):
        for i in range(new_tokens):
            mask[b, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=generator))
                mask[b, i] |= mask[b, parent]
    return mask


def make_case(batch: int, q_heads: int, kv_heads: int, new_tokens: int, past: int, head_dim: int,
              dtype: torch.dtype, device="cpu", seed: int = 0):
    """Random inputs for one case: (q, k, v, packed_mask, scale)."""
    g = torch.Generator().manual_seed(seed)
    S = past + new_tokens
    q = torch.randn(batch, q_heads, new_tokens, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, S, head_dim, generator=g)
    v = torch.randn(batch, kv_heads, S, head_dim, generator=g)
    mask = pack_tree_mask(random_tree_mask(batch, new_tokens, g))
    scale = 1.0 / math.sqrt(head_dim)
    return (q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype),
            mask.to(device), scale)


# (batch, q_heads, kv_heads, new_tokens, past, head_dim): tiny, so the CPU interpreter stays quick
CASES = {
    "chain_no_past_d16": (1, 2, 2, 5, 0, 16),
    "tree_small_past_d32_gqa2": (1, 4, 2, 7, 3, 32),
    "tree_past_not_block_multiple_d64": (1, 2, 1, 9, 37, 64),
    "tree_two_mask_words_gqa3": (2, 3, 1, 40, 5, 16),
    "tree_t32_exact_word": (1, 1, 1, 32, 17, 16),
    "head_dim_48_padded": (1, 2, 2, 6, 11, 48),
}

TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def run_case(name: str, dtype: torch.dtype, device="cpu", seed: int = 0, **launch) -> dict:
    """Kernel vs reference on one named case; returns a JSON-able record with the max abs error."""
    q, k, v, mask, scale = make_case(*CASES[name], dtype=dtype, device=device, seed=seed)
    got = tree_attention(q, k, v, mask, scale, **launch)
    want = reference_tree_attention(q, k, v, mask, scale)
    err = (got.float() - want.float()).abs().max().item()
    tol = TOLERANCE[dtype]
    return {"case": name, "dtype": str(dtype).replace("torch.", ""), "max_abs_err": err, "tol": tol,
            "finite": bool(torch.isfinite(got.float()).all()), "ok": bool(err <= tol)}
