"""Sampling parameters, the one logits processor shared by drafts and the target, and the
batched sampler of data generation: the project's one sampling module.

Lossless speculative sampling needs the draft distribution q and the target distribution p
to be produced by the *same* processing (temperature, top-k, top-p); both go through
:func:`probs_from_logits`, and :func:`sample` draws from it. Temperature 0 means greedy
(argmax) decoding.

:func:`sample_batch` draws one token per row straight from logits with the same rule, for
training-data generation (``specfoundry.train.generation``: ~48 rows over the full vocabulary at
every step), without building the processed distribution that verification needs. Both draw by
inverse CDF and find nuclei without a full-vocabulary sort where they can: ``torch.multinomial``
and ``torch.sort`` over a 49k vocabulary cost more per step than a model step of the default
target on a CPU (numbers at the functions). ``tests/test_sampling.py`` checks that the paths
draw from the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_layers


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        # one sentence per bad value here, not a failure deep inside torch.multinomial
        from .adaptive import check_int, check_real

        object.__setattr__(self, "temperature", check_real("temperature", self.temperature, 0.0))
        if self.top_k is not None:
            object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 1))
        if self.top_p is not None:
            top_p = check_real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
            object.__setattr__(self, "top_p", top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draft_params(params: SamplingParams, scale: float) -> SamplingParams:
    """The processing a drafter draws its proposals with for a request sampling with ``params``: the
    same top-k / top-p at ``scale`` times the temperature (greedy stays greedy). Any scale keeps the
    output lossless: the verifier compares the target's ``p`` with the ``q`` each draft was really drawn
    from (``Draft.q``); the scale only changes how often drafts are accepted (``runtime/calibrate.py``)."""
    if params.greedy or scale == 1.0:
        return params
    return SamplingParams(params.temperature * scale, params.top_k, params.top_p)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (first maximal index; NaN counts as maximal), widened to float32 first
    for bf16/fp16 logits on a CPU: widening is exact, so the index is the same, and PyTorch's CPU
    argmax over bf16 runs ~5x slower than widen + argmax (measured at 16 x 49152: 5.2 ms vs 1.0 ms,
    1 thread; a bf16 tree verification spent 1.5 ms per step in it); where the CPU has avx512_bf16, one
    C pass over the bf16 values (:func:`.cpu_layers.argmax`; ~0.3 ms -> ~0.01 ms for a 3-row verification)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float16):
        fast = cpu_layers.argmax(logits)  # bf16 on CPUs with avx512_bf16: one pass, no widened copy
        if fast is not None:
            return fast
        logits = logits.float()
    return logits.argmax(-1)


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the sampling distribution over the last dim of ``logits`` (any leading shape).

    Computed in float32 at least (float64 stays float64) so that draft and target
    probabilities are comparable. Greedy params give a one-hot at the argmax.
    """
    work_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(work_dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(work_dtype)
    scaled = logits / params.temperature
    overflow = ~torch.isfinite(scaled.amax(-1, keepdim=True))
    if bool(overflow.any()):
        # rows where the temperature is so small that the scaled logits overflow (softmax would
        # give NaN) take the T -> 0 limit: uniform over their maximal logits
        top = logits == logits.amax(-1, keepdim=True)
        limit = torch.zeros_like(scaled).masked_fill(~top, float("-inf"))
        scaled = torch.where(overflow, limit, scaled)
    logits = scaled
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _nucleus_parts(probs: torch.Tensor, top_p: float):
    """The nucleus of each row of ``probs`` ``[B, V]``: yields ``(rows, kept, index)`` groups where
    ``kept[i]`` are row ``rows[i]``'s largest probabilities in descending order, zero past the
    smallest prefix whose mass reaches ``top_p`` (the token crossing it is kept), at the
    vocabulary positions ``index[i]``.

    Without a full-vocabulary sort where it can: a sort of one 49k-token row costs ~3-5 ms on one
    CPU thread (a 4-node verification at top-p 0.9 paid ~16-22 ms for it; batch 48: ~150 ms),
    ``topk(64)`` ~0.06 ms, ``topk(8192)`` ~0.6 ms. When a row's top-k candidates hold >= ``top_p``
    of the mass its nucleus lies inside them (every later token has at least that much mass before
    it); rows where they do not move on to a larger k, and finally to the full sort. The same
    tokens as the sort-based rule (ties at the boundary aside, whose order neither ``sort`` nor ``topk`` defines)."""
    V = probs.shape[-1]
    rows = torch.arange(probs.shape[0], device=probs.device)
    for k in (64, 1024, 8192, V):
        k = min(k, V)
        sub = probs[rows]
        sp, si = sub.topk(k, dim=-1) if k < V else sub.sort(dim=-1, descending=True)
        cum = sp.cumsum(-1)
        ok = cum[:, -1] >= top_p if k < V else torch.ones(len(rows), dtype=torch.bool, device=probs.device)
        if bool(ok.any()):
            # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
            yield rows[ok], sp[ok].masked_fill((cum[ok] - sp[ok]) >= top_p, 0.0), si[ok]
        rows = rows[~ok]
        if rows.numel() == 0:
            break


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` ``[..., V]`` restricted to its nucleus (:func:`_nucleus_parts`), renormalised."""
    flat = probs.reshape(-1, probs.shape[-1])
    kept = torch.zeros_like(flat)
    for rows, keep, index in _nucleus_parts(flat, top_p):
        kept[rows] = keep.new_zeros(len(rows), flat.shape[-1]).scatter_(-1, index, keep)
    return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of ``probs`` ``[..., V]`` -> ``[...]`` (long).

    By inverse CDF over a float64 running sum (one uniform per row): exact to float64 rounding,
    and ~0.1 ms for a 49k-token row on one CPU thread where ``torch.multinomial`` took 1.1-1.4 ms
    -- paid by every sampled step, plain or speculative, and by every sampled draft token."""
    flat = probs.reshape(-1, probs.shape[-1])
    if flat.shape[0] == 0:
        return torch.zeros(probs.shape[:-1], dtype=torch.long, device=probs.device)
    flat = flat.double()
    total = flat.sum(-1)
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sample: every row of probs needs a positive, finite total mass")
    return _inverse_cdf(flat, generator).reshape(probs.shape[:-1])


def sample_batch(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                 uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens ``[B]`` from ``logits`` ``[B, V]`` (float32), drawn from the distribution of
    :func:`probs_from_logits` with ``params`` (greedy params: the argmax).

    For batched generation over a full vocabulary (no full sort unless a row's nucleus needs
    it). ``logits`` is not modified. ``uniforms`` ``[B]`` in [0, 1): each row's one uniform draw,
    given by the caller (per-row random streams make a row's tokens independent of its batch);
    None draws them from ``generator``.
    """
    if params.greedy:
        return logits.argmax(-1)
    logits = logits / params.temperature
    top_k, top_p = params.top_k, params.top_p
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is None or top_p >= 1.0:
        return _inverse_cdf(probs, generator, uniforms)
    # nucleus sampling from each row's top candidates, without a full-vocabulary sort
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows, keep, index in _nucleus_parts(probs, top_p):
        u = None if uniforms is None else uniforms[rows.to(uniforms.device)]  # rows on the logits device (CUDA)
        out[rows] = index.gather(-1, _inverse_cdf(keep, generator, u)[:, None]).squeeze(-1)
    return out


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None,
                 uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One sample per row of non-negative ``weights`` ``[B, K]`` (need not sum to 1), by one
    uniform draw per row (``uniforms`` ``[B]``, else from ``generator``) against the running sum:
    ``torch.multinomial`` over a 49k vocabulary at batch 48 took ~65 ms per step on one CPU
    thread, this takes a few."""
    cdf = weights.cumsum(-1)
    if uniforms is None:
        u = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=cdf.dtype)
    else:
        u = uniforms.to(weights.device, cdf.dtype).view(-1, 1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=weights.shape[-1] - 1).squeeze(-1)


def tree_log_probs(logits: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """Log-probabilities ``[..., Vd]`` (in ``work``) a greedy tree search ranks its candidates by: the
    C log-softmax of bf16 logits where it runs (what ``cpu_layers.eagle3_draft`` ranks by, so every
    search keeps the same nodes), else ``torch.log_softmax``."""
    logp = cpu_layers.log_softmax(logits) if work == torch.float32 else None
    return torch.log_softmax(logits.to(work), dim=-1) if logp is None else logp
