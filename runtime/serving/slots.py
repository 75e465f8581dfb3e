"""KV slots for continuous batching on the engine: sequences of unequal length in one cache.

Scope: the cache layout of the serving batch and the one batched forward that runs over it
(nothing about requests or scheduling; see :mod:`.scheduler`).

:class:`SlotCache` keeps ``[layers, 2, slots, kv_heads, capacity, head_dim]``; the active
sequences always occupy rows ``0 .. active-1`` (a leaving sequence's row is refilled with the
last row, one copy of that row's committed entries), so every batched step works on a view.
Each row has its own committed length: a step writes row ``b``'s ``n`` new tokens (a padded
draft tree, or one token for plain decoding) at ``length[b] .. length[b]+n`` and attends with a
per-row mask (the row's prefix plus its own tree block). :meth:`SlotCache.commit` keeps the
accepted nodes of every row with one indexed copy of only the entries that move.

Attention reads only what the rows use: the rows are split into contiguous ranges
(:func:`row_groups`), each attending over its own longest row's columns with its own longest
draft's queries, so one long prompt (or one long draft) in the batch does not make every short
row read its width (measured before this: 32 rows with prompts of 40-1100 tokens spent 80% of a
step in attention over padded, masked columns).
"""

from __future__ import annotations

import itertools
import os

import torch

from .. import cpu_attention
from ..engine import LlamaEngine, StaticKVCache, attend, grouped_attention
from ..kvcache import TransposedKeys, prefill_causal, row_mask
from ..target import TargetOutput


class SlotCache:
    """KV for up to ``slots`` sequences of at most ``capacity`` tokens each (see the module doc)."""

    def __init__(self, engine: LlamaEngine, slots: int, capacity: int):
        if slots < 1 or capacity < 2:
            raise ValueError(f"slots ({slots}) must be >= 1 and capacity ({capacity}) >= 2")
        self.engine = engine
        with torch.inference_mode():
            self.kv = torch.zeros(engine.num_layers, 2, slots, engine.hkv, capacity, engine.head_dim,
                                  dtype=engine.dtype, device=engine.device)
        self.lengths: list[int] = [0] * slots
        self.active = 0
        # plain and mostly plain steps' attention by the CPU kernel where it runs (runtime/cpu_attention.py,
        # :func:`uses_kernel`), else SDPA per range of rows; SPECFOUNDRY_SLOT_ATTENTION=sdpa keeps SDPA
        self.kernel = os.environ.get("SPECFOUNDRY_SLOT_ATTENTION", "auto") != "sdpa" and \
            cpu_attention.supports(self.kv[0]) and cpu_attention.available()
        # on the AVX-512 BF16 kernel every step attends by the kernel, drafted rows or not (KERNEL_TOKENS_PER_ROW)
        self.rows_kernel = self.kernel and cpu_attention.rows_kernel(self.kv[0])
        # row 0's K also transposed, for a lone row's steps on the layer kernel (_one_row); its count of
        # columns that match K drops to 0 where row 0's committed columns change: remove (row 0 is only
        # added again after that), while commits move pending entries only (past what it holds)
        self._kt = TransposedKeys()

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def capacity(self) -> int:
        return self.kv.shape[4]

    def transposed_keys(self) -> tuple[torch.Tensor, int] | None:
        """Row 0's K transposed (:class:`~..kvcache.TransposedKeys`) and the first committed column it
        does not hold, for :func:`_one_row`; None where the layer kernel does not read it (not bf16 on CPU)."""
        if self.kv.dtype != torch.bfloat16 or self.kv.device.type != "cpu":
            return None
        L, _, _, hkv, cap, D = self.kv.shape
        return self._kt.get(L, hkv, cap, D, self.lengths[0])

    def keys_transposed_to(self, length: int) -> None:
        """Row 0's transposed keys match its first ``length`` committed columns."""
        self._kt.held_to(min(length, self.lengths[0]))

    @torch.inference_mode()
    def add(self, prefill: StaticKVCache | None = None) -> int:
        """Open the next row for a new sequence, holding the committed entries of ``prefill`` (a
        batch-1 cache the prompt was prefilled into; None: empty); returns its index."""
        if self.active >= self.slots:
            raise RuntimeError("no free slot")
        row = self.active
        n = prefill.length if prefill is not None else 0
        if n > self.capacity:
            raise ValueError(f"a prefill of {n} entries exceeds the slot capacity ({self.capacity})")
        if n:
            self.kv[:, :, row, :, :n] = prefill.kv[:, :, 0, :, :n]
        self.active += 1
        self.lengths[row] = n
        return row

    @torch.inference_mode()
    def remove(self, row: int) -> int | None:
        """Free ``row``; the last active row moves into it. Returns the moved row's old index (the
        caller re-keys its per-row state) or None when ``row`` was the last."""
        last = self.active - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not active ({self.active} active)")
        self.active = last
        if row == 0:  # another sequence moves in, or none is left (the next one is added here)
            self._kt.held_to(0)
        if row == last:
            return None
        n = self.lengths[last]
        self.kv[:, :, row, :, :n] = self.kv[:, :, last, :, :n]
        self.lengths[row] = n
        return last

    @torch.inference_mode()
    def commit(self, keeps: list[torch.Tensor]) -> None:
        """After :func:`forward_slots`: row ``b`` keeps its new entries ``keeps[b]`` (sorted indices
        into that row's new tokens). Entries already in place stay; the rest move in one copy."""
        rows, src, dst = [], [], []
        for b, keep in enumerate(keeps):
            keep = keep.tolist()
            base = self.lengths[b]
            for j, k in enumerate(keep):
                if k != j:
                    rows.append(b)
                    src.append(base + k)
                    dst.append(base + j)
            self.lengths[b] = base + len(keep)
        if rows:
            r = torch.tensor(rows, device=self.kv.device)
            self.kv[:, :, r, :, torch.tensor(dst, device=self.kv.device)] = \
                self.kv[:, :, r, :, torch.tensor(src, device=self.kv.device)]


# one attention call's fixed cost in row-columns (what one row reading one more cached column costs):
# ~15 us per SDPA call against ~0.09 us per row-column, bf16, 1 thread, this project's 2-core CPU
GROUP_OVERHEAD_COLUMNS = 160
# a row-column's cost grows with the row's queries n as (QUERY_FIXED + n) (CPU SDPA over a few query
# rows is mostly fixed work per column: measured for 32 rows, 1 layer, bf16, 1 thread, n = 1/2/6 ->
# 1.00/1.12/1.65, i.e. ~(6 + n)/7)
QUERY_FIXED = 6
#: the CPU kernel attends a step whose real tokens average at most this many per row (above it, SDPA
#: per range of rows). The kernel's work grows with a row's queries, SDPA's mostly with its columns:
#: with every row at 2-4 tokens SDPA won on the eleventh session's CPU (1.1-1.8x) and lost on the
#: twentieth's (kernel 0.84-0.97x); a mostly plain step with a few drafted rows (prompt lookup, probes,
#: under load) was 0.66-0.83x SDPA's at 8-32 rows (docs/results.md, twentieth session): on SDPA, one
#: draft among 16 plain rows made the whole step the slower kind. The AVX-512 BF16 kernel (bf16 caches
#: on CPUs with avx512_bf16) takes every step whatever its tokens: 1.26-1.48x SDPA's whole step at 4-16
#: rows of 2-5 tokens each, 1 and 2 threads (docs/results.md, twenty-third session)
KERNEL_TOKENS_PER_ROW = 1.5


def uses_kernel(cache: SlotCache, rows: int, tokens: int) -> bool:
    """Whether a step of ``rows`` rows with ``tokens`` real tokens in all attends with the CPU kernel
    (see :data:`KERNEL_TOKENS_PER_ROW`)."""
    return cache.kernel and (cache.rows_kernel or tokens <= KERNEL_TOKENS_PER_ROW * rows)


def row_groups(lengths: list[int], counts: list[int] | None = None,
               overhead: int | None = None) -> list[tuple[int, int, int, int]]:
    """Contiguous row ranges ``(start, end, n, width)`` covering rows ``0..len(lengths)-1``: the
    range's rows attend with ``n = max(counts[start:end])`` query tokens each (a row's real tokens,
    the rest padding) over ``width = max(lengths[start:end]) + n`` columns. Chosen to minimise the
    padded work ``rows * width * (QUERY_FIXED + n) / (QUERY_FIXED + 1)`` plus ``overhead`` per range
    (default :data:`GROUP_OVERHEAD_COLUMNS`), exactly, by dynamic programming over the split points
    (O(rows^2)): one long prompt, or one long draft, among short ones gets a range of its own
    instead of making every row read its columns or pad to its tokens. ``counts`` None: 1 each."""
    overhead = GROUP_OVERHEAD_COLUMNS if overhead is None else overhead
    B = len(lengths)
    counts = counts or [1] * B
    best, cut = [0.0] + [float("inf")] * B, [0] * (B + 1)
    for e in range(1, B + 1):
        w = n = 0
        for s in range(e - 1, -1, -1):
            w, n = max(w, lengths[s]), max(n, counts[s])
            c = best[s] + (e - s) * (w + n) * (QUERY_FIXED + n) / (QUERY_FIXED + 1) + overhead
            if c < best[e]:
                best[e], cut[e] = c, s
    groups, e = [], B
    while e > 0:
        s = cut[e]
        n = max(counts[s:e])
        groups.append((s, e, n, max(lengths[s:e]) + n))
        e = s
    return groups[::-1]


def forward_slots(cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor,
                  block: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                  counts: list[int] | None = None) -> TargetOutput:
    """One batched step over the ``B = cache.active`` rows: ``tokens``/``positions`` ``[B, n]``,
    ``block`` ``[B, n, n]`` bool tree masks among each row's new tokens (None = causal). The new
    entries are written after each row's committed length; :meth:`SlotCache.commit` keeps some.
    ``counts``: each row's real tokens (the rest is padding): see :func:`forward_mixed`."""
    return forward_mixed(cache, tokens, positions, block, [], feature_layers, counts)[0]


@torch.inference_mode()
def forward_mixed(cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, block: torch.Tensor | None,
                  chunks: list[tuple[StaticKVCache, torch.Tensor]], feature_layers: tuple[int, ...] = (),
                  counts: list[int] | None = None
                  ) -> tuple[TargetOutput | None, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """:func:`forward_slots` for the ``B`` active rows (``tokens`` ``[B, n]``; ``B`` may be 0) and,
    in the same forward, prompt chunks of requests being prefilled (chunked prefill): each
    ``(prefill cache, ids [c])`` continues its own batch-1 cache (positions = its length onwards,
    causal) and is committed there. The linears run once over all ``B*n + sum(c)`` tokens: the
    decode rows' weight reads and fixed costs are shared with the prefill.

    ``counts[b]``: row ``b``'s real tokens (its draft's nodes), the rest of its ``n`` being padding
    to the longest draft. Only real tokens go through the linears and the LM head (rows drafting
    different lengths, e.g. one prompt-lookup chain of 5 among chains of 2 or plain rows, would
    otherwise make every row pay for the longest), and attention pads each range of rows
    (:func:`row_groups`) only to that range's longest draft (measured before: one lookup chain of 5
    among 31 plain rows made the step cost 1.36x plain, all of it attention over padded queries). The
    decode output keeps the ``[B, n, ...]`` shape; a padding position's logits and features are
    left unset (never read: verification reads ``:counts[b]``). None: every token is real.

    Returns (the decode rows' output, None when ``B`` is 0; per chunk (the logits of its last token
    ``[V]``, its features ``[1, c, F, H]`` or None without ``feature_layers``))."""
    engine = cache.engine
    dev = engine.device
    B, n = tokens.shape
    if B == 1 and not chunks:
        one = _one_row(cache, tokens, positions, block, feature_layers, counts)
        if one is not None:
            return one, []
    real = None  # flat indices of the real decode tokens, when some are padding
    if counts is not None and B:
        if len(counts) != B or min(counts) < 1 or max(counts) > n:
            raise ValueError(f"counts must give 1..{n} real tokens for each of the {B} rows, got {counts}")
        if sum(counts) < B * n:
            have = torch.tensor(counts, device=dev).view(B, 1)
            real = (torch.arange(n, device=dev).view(1, n) < have).view(-1).nonzero().view(-1)
    T = B * n if real is None else int(real.shape[0])
    dec_tokens, dec_pos = tokens.to(dev).reshape(-1), positions.to(dev).reshape(-1)
    if real is not None:
        dec_tokens, dec_pos = dec_tokens[real], dec_pos[real]
    sizes = [T] + [int(ids.shape[0]) for _, ids in chunks]
    pos = [dec_pos] + [pc.length + torch.arange(ids.shape[0], device=dev) for pc, ids in chunks]
    flat = torch.cat([dec_tokens] + [ids.to(dev) for _, ids in chunks]).view(1, -1)
    cos, sin = engine.rope(torch.cat(pos).view(1, -1))
    decode = _slot_attention(cache, B, n, block, counts or [n] * B) if B else None
    masks, causal, kernel = [], [], []
    for pc, ids in chunks:
        pc.check_ready()
        c = int(ids.shape[0])
        pc.reserve(c)
        # the chunk sees its request's earlier chunks and itself causally: on the engine's causal prefill
        # kernel where it runs (a one-sequence bf16 cache, as the engine's own prefill), else by SDPA, where
        # one token needs no mask, and a first chunk none either (its causal flag: kvcache.prefill_causal)
        kernel.append(engine.prefill_kernel and cpu_attention.prefill_supports(pc.kv[0], 1, c))
        causal.append(prefill_causal(None, pc.length, c, dev))
        m = None if c == 1 or causal[-1] or kernel[-1] else \
            torch.ones(c, pc.length + c, dtype=torch.bool, device=dev).tril(pc.length)
        masks.append(None if m is None else m.repeat(engine.groups, 1).view(1, 1, engine.groups * c, -1))

    def padded(t: torch.Tensor) -> torch.Tensor:
        """Real decode outputs ``[T, ...]`` -> ``[B, n, ...]``, padding left unset (never read)."""
        if real is None:
            return t.view(B, n, *t.shape[1:])
        return t.new_empty(B * n, *t.shape[1:]).index_copy_(0, real, t).view(B, n, *t.shape[1:])

    def attention(i, q, k, v):
        qs, ks, vs = (t[0].split(sizes) for t in (q, k, v))
        outs = [decode(i, qs[0], ks[0], vs[0])] if B else []
        for (pc, _), m, cz, kern, qc, kc, vc in zip(chunks, masks, causal, kernel, qs[1:], ks[1:], vs[1:]):
            if kern:
                outs.append(cpu_attention.prefill_attention(pc.kv[i], qc[None], kc[None], vc[None], pc.length,
                                                            engine.scale)[0])
            else:
                outs.append(attend(pc.kv[i], qc[None], kc[None], vc[None], pc.length, m, engine.scale, cz)[0])
        return torch.cat(outs).view(1, flat.shape[1], -1)

    x, feats = engine.run_layers(flat, cos, sin, attention, feature_layers)
    for pc, ids in chunks:
        pc.mark_appended(int(ids.shape[0]))
        pc.commit()
    ends = torch.tensor(sizes, device=dev).cumsum(0)
    logits_for = torch.cat([torch.arange(T, device=dev), ends[1:] - 1])  # decode rows, each chunk's last
    out = engine.finish(x, feats, feature_layers, logits_for)
    features = out.features[0].split(sizes) if out.features is not None else [None] * len(sizes)

    dec = None
    if B:
        dec = TargetOutput(logits=padded(out.logits[0, :T]),
                           features=None if out.features is None else padded(features[0]))
    return dec, [(out.logits[0, T + j], None if f is None else f.unsqueeze(0)) for j, f in enumerate(features[1:])]


def _one_row(cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, block: torch.Tensor | None,
             feature_layers: tuple[int, ...], counts: list[int] | None) -> TargetOutput | None:
    """A step of one active row and no prefill chunk through the engine's layer kernel (one C call for
    all layers, :meth:`~..engine.LlamaEngine.kernel_layers`), as the single-sequence generator runs it: a server with one
    client decodes at the engine's single-stream speed. None where the kernel does not take it."""
    engine = cache.engine
    n = tokens.shape[1]
    c = n if counts is None else counts[0]
    if cache.active != 1 or not 1 <= c <= n:
        return None
    kv = cache.kv[:, :, :1]  # row 0: the only active one
    blk = None if block is None else block[:, :c, :c].to(engine.device)
    table = engine._layer_table(1, c, blk, kv)
    past = cache.lengths[0]
    if table is None or past + c > cache.capacity:
        return None
    cos, sin = engine.rope(positions[:, :c].to(engine.device))
    keys_t = cache.transposed_keys()  # the scores read K transposed, as the engine's own forward does
    x, feats = engine.kernel_layers(table, tokens[:, :c], cos, sin, kv, past, blk, feature_layers, keys_t)
    if keys_t is not None:
        cache.keys_transposed_to(past)  # the new columns are pending: the commit may move them
    out = engine.finish(x, feats, feature_layers, None)
    if c == n:
        return out
    # padding positions (counts[0] < n) are left unset, as in forward_mixed: never read
    logits = out.logits.new_empty(1, n, out.logits.shape[-1])
    logits[:, :c] = out.logits
    features = None
    if out.features is not None:
        features = out.features.new_empty(1, n, *out.features.shape[2:])
        features[:, :c] = out.features
    return TargetOutput(logits=logits, features=features)


def _slot_attention(cache: SlotCache, B: int, n: int, block: torch.Tensor | None, counts: list[int]):
    """The attention of :func:`forward_slots` for rows ``0..B-1``, row ``b`` with ``counts[b]``
    real tokens of its ``n``: returns ``attention(layer, q, k, v)`` over the real tokens (flat
    ``[T, heads, D]``, rows in order) that writes their K/V after each row's committed length and
    attends: in a plain or mostly plain step (:func:`uses_kernel`) with the CPU kernel
    (:mod:`..cpu_attention`, where it runs), every row over its own columns in one call; else by
    SDPA per range of rows (:func:`row_groups`), each range padded only to its own longest draft (a
    padding query sees what ``block`` gives it and its output is dropped)."""
    engine = cache.engine
    dev = engine.device
    if B != cache.active:
        raise ValueError(f"{B} rows of tokens for {cache.active} active slots")
    lens = cache.lengths[:B]
    if max(lens) + n > cache.capacity:
        raise ValueError(f"a row would exceed the slot capacity ({cache.capacity} tokens)")
    if block is None:
        block = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, n, n)
    block = block.to(dev)
    lengths = torch.tensor(lens, device=dev)
    T = sum(counts)
    # where each real token's K/V goes: its row, at the row's committed length + its index
    starts = [0, *itertools.accumulate(counts[:-1])]  # each row's first real token
    rows = torch.repeat_interleave(torch.arange(B, device=dev), torch.tensor(counts, device=dev))
    first = torch.tensor(starts, device=dev)
    write = lengths[rows] + torch.arange(T, device=dev) - first[rows]
    kv = cache.kv
    if uses_kernel(cache, B, T):  # every row over its own columns in one call, no ranges
        i32 = (lengths.int(), torch.tensor(counts, dtype=torch.int32), first.int())
        blk = block.to(torch.uint8).contiguous()

        def kernel_attention(i, q, k, v):
            layer = kv[i]
            layer[0][rows, :, write] = k
            layer[1][rows, :, write] = v
            return cpu_attention.slot_attention(q, layer, *i32, blk, engine.scale)

        return kernel_attention
    groups, masks, gather = row_groups(lens, counts), [], []
    for s, e, m, _ in groups:
        # a range whose rows are all at one length, one token each, needs no mask (plain causal attention)
        plain = m == 1 and min(lens[s:e]) == max(lens[s:e])
        masks.append(None if plain else row_mask(lengths[s:e], block[s:e, :m, :m], engine.groups))
        for r in range(s, e):  # the range's [rows, m] tokens: real ones by flat index, padding as T
            gather.extend(starts[r] + j if j < counts[r] else T for j in range(m))
    padding = len(gather) != T
    if padding:
        gather = torch.tensor(gather, device=dev)
        keep = (gather < T).nonzero().view(-1)  # the real tokens among the ranges' outputs, in order

    def attention(i, q, k, v):
        layer = kv[i]
        layer[0][rows, :, write] = k  # [T, hkv, D], each real token at its row's own column
        layer[1][rows, :, write] = v
        if padding:
            q = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[gather]
        outs, at = [], 0
        for (s, e, m, w), mask in zip(groups, masks):
            qg = q[at: at + (e - s) * m].view(e - s, m, *q.shape[1:])
            at += (e - s) * m
            outs.append(grouped_attention(qg, layer[0, s:e, :, :w], layer[1, s:e, :, :w], mask,
                                          engine.scale).view((e - s) * m, -1))
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return o[keep] if padding else o

    return attention
