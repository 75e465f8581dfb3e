"""The static KV cache and attention over it: what a decode step writes and reads.

Scope: :class:`StaticKVCache` (preallocated ``[layers, 2, batch, kv_heads, capacity, head_dim]``,
in-place commit of accepted tree nodes), the attention mask buffer (:class:`MaskBuffer`), RoPE application and grouped-query attention over cache slices. Used by the
target engine (:mod:`.engine`), the EAGLE heads' drafting steps, the serving slots and the
CUDA-graph step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["MaskBuffer", "StaticKVCache", "TransposedKeys", "attend", "grouped_attention", "prefill_causal", "rotate",
           "row_mask"]


#: query tokens above which attention pads them to a multiple of this (see :func:`grouped_attention`)
QUERY_BUCKET = 16

#: SDPA backends allowed on CUDA (empty = PyTorch's own choice). Every one but cuDNN's: cuDNN builds
#: an execution graph per new shape, and a decode or verification step sees a new key length every
#: step. On an H200 (torch 2.11) one SDPA call at a key length not seen before cost 62.7 ms with
#: PyTorch's own choice and 0.12 ms again; without cuDNN 0.17 ms either way (tools/gpu_run.py's
#: ``sdpa_new_lengths``; docs/results.md, twenty-fifth and twenty-sixth sessions).
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (HF's rotate-half convention) of ``x`` ``[B, n, heads, D]`` with ``cos``/``sin`` ``[B, n, 1, D]``."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def attend(layer_kv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
           mask: torch.Tensor | None, scale: float, causal: bool = False) -> torch.Tensor:
    """Write ``k``/``v`` ``[B, n, hkv, D]`` into ``layer_kv`` ``[2, B, hkv, capacity, D]`` at
    ``past .. past+n`` and attend ``q`` ``[B, n, hq, D]`` over ``0 .. past+n`` -> ``[B, n, hq*D]``.

    Grouped-query attention without repeating K/V: the ``g`` query heads of one KV head are
    stacked as ``g * n`` query rows against it (``mask`` from :class:`MaskBuffer` has that layout).
    ``causal``: a prefill (``past`` 0, no mask): see :func:`prefill_causal`.
    """
    n = q.shape[1]
    layer_kv[0, :, :, past: past + n].copy_(k.transpose(1, 2))
    layer_kv[1, :, :, past: past + n].copy_(v.transpose(1, 2))
    if causal:
        if past or mask is not None:
            raise ValueError("causal attention is a prefill's: past 0 and no mask")
        return _causal_attention(q, layer_kv[0, :, :, :n], layer_kv[1, :, :, :n], scale)
    return grouped_attention(q, layer_kv[0, :, :, : past + n], layer_kv[1, :, :, : past + n], mask, scale)


def prefill_causal(block: torch.Tensor | None, past: int, n: int, device: torch.device) -> bool:
    """Whether a step attends by SDPA's causal flag instead of a mask: a CPU prefill of several
    tokens into an empty cache, causal among them. Why: the fused kernel then skips the blocks above
    the diagonal and builds no mask; SmolLM2-135M's 30 layers at 1500 tokens, 2 threads: 723 vs
    1231 ms of a 2.2 s prefill, the same values (twenty-ninth session, ``docs/results.md``)."""
    return block is None and past == 0 and n > 1 and torch.device(device).type == "cpu"


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[B, n, hq, D]`` causally against ``keys``/``values`` ``[B, hkv, n, D]`` -> ``[B, n, hq*D]``
    (SDPA's grouped-query mode; rows padded as in :func:`grouped_attention`, the padding dropped)."""
    B, n, hq, D = q.shape
    pad = (-n) % QUERY_BUCKET if n > QUERY_BUCKET else 0
    qh = F.pad(q, (0, 0, 0, 0, 0, pad)).transpose(1, 2) if pad else q.transpose(1, 2)
    # extra query rows past the keys see all of them (causal from the top left) and are dropped
    o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return o[:, :, :n].transpose(1, 2).reshape(B, n, hq * D)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """``q`` ``[B, n, hq, D]`` against ``keys``/``values`` ``[B, hkv, S, D]`` -> ``[B, n, hq*D]``, the
    ``g = hq/hkv`` query heads of one KV head stacked as ``g * n`` rows (``mask`` ``[B, 1, g*n, S]``)."""
    B, n, hq, D = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    # PyTorch's CPU SDPA keeps a JIT kernel per query-row count it has seen, and never frees them
    # (measured: +80 MB of native memory over ~1,100 distinct prefill chunk lengths, the rise of a
    # server's RSS in the soak, docs/results.md twelfth session). Past QUERY_BUCKET tokens the rows
    # are padded to a multiple of it (the extra rows are dropped), so long-running processes see
    # few distinct shapes; shorter steps (decode, drafts) already have few.
    pad = (-n) % QUERY_BUCKET if n > QUERY_BUCKET else 0
    m = n + pad
    if pad:
        q = F.pad(q, (0, 0, 0, 0, 0, pad))
        if mask is not None:  # [..., g*n, S] -> [..., g*m, S]; padded rows see every column
            lead, S = mask.shape[:-2], mask.shape[-1]
            mask = F.pad(mask.reshape(*lead, g, n, S), (0, 0, 0, pad), value=True if mask.dtype == torch.bool else 0.0) \
                .reshape(*lead, g * m, S)
    qg = q.reshape(B, m, hkv, g, D).permute(0, 2, 3, 1, 4).reshape(B, hkv, g * m, D)
    if qg.is_cuda and CUDA_SDPA_BACKENDS:
        with sdpa_kernel(list(CUDA_SDPA_BACKENDS)):
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return o.view(B, hkv, g, m, D)[:, :, :, :n].permute(0, 3, 1, 2, 4).reshape(B, n, hq * D)



def row_mask(starts: torch.Tensor, block: torch.Tensor, groups: int) -> torch.Tensor:
    """Bool ``[B, 1, g*n, max(starts)+k]`` for rows of unequal length (the serving slots' forward,
    the heads' batched drafting): row ``b`` sees its first ``starts[b]`` columns and, over columns
    ``starts[b] .. starts[b]+k``, what ``block`` ``[B, n, k]`` allows (``k = n``: the new tokens'
    own block; ``k > n``: a draft tree's earlier entries as well)."""
    B, n, k = block.shape
    cols = int(starts.max()) + k
    col = torch.arange(cols, device=block.device)
    m = (col.view(1, 1, cols) < starts.view(B, 1, 1)).expand(B, n, cols).clone()
    write = starts.view(B, 1) + torch.arange(k, device=block.device)
    m.scatter_(2, write.view(B, 1, k).expand(B, n, k), block)
    return m.repeat(1, groups, 1).unsqueeze(1)


class MaskBuffer:
    """A preallocated all-True bool buffer out of which attention masks are cut: a forward writes
    only its block over the newest columns and :meth:`release` resets it."""

    def __init__(self, groups: int, device):
        self.groups = groups
        self.buf = torch.ones(0, 0, dtype=torch.bool, device=device)

    def get(self, block: torch.Tensor | None, B: int, n: int, past: int) -> torch.Tensor | None:
        """Bool ``[B, 1, g*n, past+n]`` (True = may attend): everything before the last ``k``
        columns, and ``block`` ``[B, n, k]`` (``k <= past + n``) over them; ``block`` None means
        causal among the ``n`` new tokens, which for a plain n=1 step needs no mask at all."""
        if block is None and n == 1:
            return None
        if block is None:
            block = torch.ones(n, n, dtype=torch.bool, device=self.buf.device).tril()
        k = block.shape[-1]
        rows, cols = self.groups * n, past + n
        have_rows, have_cols = self.buf.shape
        if have_rows < B * rows or have_cols < cols:
            # each side grows only when it is too small (doubling the width whenever the rows grew
            # made a run of ever longer prompts double the buffer each time: GBs after a few)
            new_rows = have_rows if have_rows >= B * rows else B * rows
            new_cols = have_cols if have_cols >= cols else max(cols, 2 * have_cols, 1024)
            with torch.inference_mode():
                self.buf = torch.ones(new_rows, new_cols, dtype=torch.bool, device=self.buf.device)
        m = self.buf[: B * rows, :cols].view(B, 1, rows, cols)
        m[:, 0, :, cols - k:].copy_(block.to(m.device).expand(B, n, k).repeat(1, self.groups, 1))
        return m

    def release(self, mask: torch.Tensor | None, k: int) -> None:
        """Reset the last ``k`` columns :meth:`get` wrote (the block width)."""
        if mask is not None:
            mask[..., mask.shape[-1] - k:] = True


class TransposedKeys:
    """One sequence's K also stored transposed per 16-column block for the CPU layer kernel
    (:func:`.cpu_layers.run_layers`): ``[layers, kv_heads, capacity rounded up to 16, head_dim]`` bf16,
    each head's columns read as ``[capacity / 16][head_dim / 2][16][2]`` (the attention's scores then
    need no per-column reduction), and how many leading columns still match K. The cache that owns
    it lowers that count wherever its K columns change (a commit moving entries, a crop, another
    sequence moved in); the kernel writes the columns from there on before it reads them."""

    def __init__(self):
        self.kt: torch.Tensor | None = None
        self.valid = 0

    def get(self, layers: int, kv_heads: int, capacity: int, head_dim: int, length: int) -> tuple[torch.Tensor, int]:
        """(the copy, the first of the ``length`` committed columns it does not hold); allocated on
        first use or for a larger capacity (then it starts again)."""
        cap16 = (capacity + 15) // 16 * 16
        if self.kt is None or self.kt.shape[2] < cap16 or self.kt.shape[0] != layers or self.kt.shape[1] != kv_heads \
                or self.kt.shape[3] != head_dim:
            self.kt = torch.empty(layers, kv_heads, cap16, head_dim, dtype=torch.bfloat16)
            self.valid = 0
        return self.kt, min(self.valid, length)

    def held_to(self, length: int) -> None:
        """The first ``length`` columns match K."""
        self.valid = length

    def drop(self) -> None:
        self.kt, self.valid = None, 0


class StaticKVCache:
    """Preallocated KV ``[layers, 2, batch, kv_heads, capacity, head_dim]`` for ``batch``
    sequences of equal committed length.

    Same contract as :class:`~specfoundry.runtime.target.KVCache`: a forward appends ``n``
    pending entries at ``length .. length+n``; :meth:`commit` keeps some of them (in place).
    Used by the target engine and by the EAGLE heads' drafting steps.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, batch: int = 1, capacity: int = 1024,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.shape = (layers, 2, batch, kv_heads, capacity, head_dim)
        self.batch = batch
        self.kv = self._empty(capacity, dtype, device)
        self.length = 0
        self._pending = 0
        self._kt = TransposedKeys()  # K transposed per 16-column block (transposed_keys)

    @torch.inference_mode()
    def _empty(self, capacity: int, dtype, device) -> torch.Tensor:
        return torch.zeros(*self.shape[:4], capacity, self.shape[5], dtype=dtype, device=device)

    def rebatch(self, batch: int) -> None:
        """Reallocate an empty cache for ``batch`` sequences."""
        if self.length or self._pending:
            raise RuntimeError("only an empty cache can change its batch size")
        self.shape = (*self.shape[:2], batch, *self.shape[3:])
        self.batch = batch
        self.kv = self._empty(self.capacity, self.kv.dtype, self.kv.device)
        self._kt.drop()

    @property
    def capacity(self) -> int:
        return self.kv.shape[-2]

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more entries past the committed length (doubling, rarely)."""
        need = self.length + n
        if need <= self.capacity:
            return
        kv = self._empty(max(need, 2 * self.capacity), self.kv.dtype, self.kv.device)
        with torch.inference_mode():
            kv[..., : self.length, :].copy_(self.kv[..., : self.length, :])
        self.kv = kv

    def transposed_keys(self) -> tuple[torch.Tensor, int]:
        """For the CPU layer kernel (:func:`.cpu_layers.run_layers`, one sequence): K also stored
        transposed (:class:`TransposedKeys`) and how many leading columns already match K. A regrown
        cache starts it again; the caller writes it from there through its new entries and then
        records the committed length it holds with :meth:`keys_transposed_to`."""
        L, _, B, hkv, _, D = self.shape
        if B != 1 or self.kv.dtype != torch.bfloat16 or self.kv.device.type != "cpu":
            raise ValueError(f"transposed keys are kept for one CPU bf16 sequence, not batch {B} {self.kv.dtype} "
                             f"on {self.kv.device}")
        return self._kt.get(L, hkv, self.capacity, D, self.length)

    def keys_transposed_to(self, length: int) -> None:
        """The transposed keys' first ``length`` columns match K (only committed entries count: a
        commit moves pending ones, a crop drops some)."""
        self._kt.held_to(min(length, self.length))

    def check_ready(self) -> None:
        if self._pending:
            raise RuntimeError("commit or roll back the previous forward before the next one")

    def mark_appended(self, n: int) -> None:
        self._pending = n

    def commit(self, keep: torch.Tensor | list[int] | None = None) -> None:
        """Keep the pending entries at ``keep`` (``[m]`` sorted indices into the last forward's new
        tokens, a tensor or a list; None keeps all). Only the kept entries that are not already in
        place move. The indices are read on the host (a handful per step: cheaper than tensor ops
        right after a forward, and one copy on a GPU)."""
        n, past = self._pending, self.length
        self._pending = 0
        if keep is None:
            self.length = past + n
            return
        keep = keep.tolist() if isinstance(keep, torch.Tensor) else keep
        m = len(keep)
        # sorted and unique: entries before the first gap are in place
        first = next((i for i, k in enumerate(keep) if k != i), m)
        if first < m:
            with torch.inference_mode():
                src = torch.tensor(keep[first:], dtype=torch.long, device=self.kv.device) + past
                # keep[i] >= i, so writing slot past+i never clobbers a later source
                self.kv[..., past + first: past + m, :] = self.kv[..., src, :]
        self.length = past + m

    def rollback(self) -> None:
        self._pending = 0

    def crop(self, length: int) -> None:
        self._pending = 0
        self.length = min(self.length, length)
        self._kt.held_to(min(self._kt.valid, self.length))
