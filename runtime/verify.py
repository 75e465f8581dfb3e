"""Lossless verification of draft trees: pure, batch-first functions.

Scope: given a :class:`~specfoundry.runtime.tree.Draft` (``[B, N]`` tokens/parents, optional
proposal distributions ``q``) and the target's scores for every node (``[B, N, V]``; row ``i``
is the target's next-token distribution *after* node ``i``), decide which draft nodes are
accepted and which token follows them. Only exact rules exist here:

* greedy (temperature 0): a node is accepted when its token is the target argmax after its
  parent and its whole path is accepted; the output equals plain greedy decoding.
* sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023), extended to trees by
  recursive rejection over siblings (SpecInfer, EAGLE, Recursive Speculative Decoding). The
  emitted tokens are distributed exactly as sampling from the target alone.

No lossy/"typical"/relaxed acceptance is offered on purpose. All functions are vectorised over
the batch (Python loops only over tree depth and sibling rank), draw randomness only from the
given ``torch.Generator`` and never mutate their inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu_verify  # (its C kernel is built on first use)
from .sampling import SamplingParams, argmax, probs_from_logits, sample
from .tree import Draft, tree_depths

__all__ = [
    "VerifyResult",
    "verify",
    "verify_greedy_chain",
    "verify_greedy_tree",
    "verify_sampling_chain",
    "verify_sampling_tree",
]


@dataclass
class VerifyResult:
    accept_len: torch.Tensor  # [B] number of accepted draft nodes (root excluded)
    path: torch.Tensor  # [B, D+1] node indices root..last accepted, padded with -1
    next_token: torch.Tensor  # [B] bonus / correction token (the next root)
    # one sequence's (accepted count, path without padding, next token) as host values, where the
    # verifier had them without a tensor op: see lists()
    host: tuple[int, list[int], int] | None = field(default=None, repr=False, compare=False)

    def lists(self) -> tuple[int, list[int], int]:
        """One sequence's result as host values: (accepted nodes, the path root..last accepted, the
        next token); read from the tensors once when the verifier did not attach them."""
        if self.host is None:
            if self.accept_len.shape[0] != 1:
                raise ValueError(f"lists() is for one sequence, got a batch of {self.accept_len.shape[0]}")
            self.host = (int(self.accept_len[0]), [i for i in self.path[0].tolist() if i >= 0], int(self.next_token[0]))
        return self.host


# --------------------------------------------------------------------------- helpers


def _is_chain(parents: torch.Tensor) -> bool:
    N = parents.shape[1]
    chain = torch.arange(-1, N - 1, device=parents.device)
    return bool((parents == chain).all())


def _gather_nodes(x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, N, V]``, ``node`` ``[B]`` -> ``x[b, node[b]]`` ``[B, V]``."""
    return x.gather(1, node.view(-1, 1, 1).expand(-1, 1, x.shape[-1])).squeeze(1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalise(max(p - q, 0))`` over the last dim, falling back to ``p`` where that is empty.

    The residual is empty only when ``p <= q`` everywhere, i.e. ``p == q`` on the support; there
    rejection has probability 0 (up to rounding), so any choice is exact and ``p`` avoids NaN.
    """
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)


def _proposal(draft: Draft, node: torch.Tensor, token: torch.Tensor, V: int, dtype: torch.dtype) -> torch.Tensor:
    """Proposal distribution ``q`` of ``node`` ``[B]`` -> ``[B, V]`` (one-hot when ``draft.q`` is None)."""
    if draft.q is None:
        return torch.nn.functional.one_hot(token, V).to(dtype)
    return _gather_nodes(draft.q.to(dtype), node)


def _children_table(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, R]`` long: ``t[b, u, r]`` is the ``r``-th child (index order) of node ``u``, or -1."""
    B, N = parents.shape
    if N <= 1:
        return parents.new_full((B, N, 0), -1)
    # sibling rank = number of earlier nodes sharing the parent
    earlier = torch.ones(N, N, dtype=torch.bool, device=parents.device).tril(-1)
    rank = ((parents[:, :, None] == parents[:, None, :]) & earlier).sum(-1)[:, 1:]
    R = int(rank.max()) + 1
    flat = parents.new_full((B, N * R), -1)
    idx = parents[:, 1:] * R + rank
    src = torch.arange(1, N, device=parents.device).expand(B, N - 1)
    return flat.scatter(1, idx, src).view(B, N, R)


def _path(parents: torch.Tensor, depths: torch.Tensor, node: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Same as :func:`tree.path_to` but reusing ``depths`` and without boolean indexing."""
    B = parents.shape[0]
    anc = [node]  # anc[s] = s-th ancestor of node (stuck at the root once reached)
    for _ in range(max_depth):
        anc.append(parents.gather(1, anc[-1].view(B, 1)).squeeze(1).clamp(min=0))
    anc = torch.stack(anc, 1)  # [B, max_depth + 1]
    d = depths.gather(1, node.view(B, 1))  # [B, 1]
    col = torch.arange(max_depth + 1, device=parents.device).view(1, -1)
    out = anc.gather(1, (d - col).clamp(min=0))  # column j holds the ancestor at depth j
    return torch.where(col <= d, out, torch.full_like(out, -1))


def _over_target_vocab(draft: Draft, V: int) -> Draft:
    """``draft`` with ``q`` over the target vocabulary (the PyTorch verifiers gather from it by target id)."""
    if draft.q_ids is None:
        return draft
    return Draft(draft.tokens, draft.parents, draft.target_q(V), host=draft.host)


def _check(draft: Draft, scores: torch.Tensor) -> None:
    if scores.dim() != 3 or scores.shape[:2] != draft.tokens.shape:
        raise ValueError(f"target scores {tuple(scores.shape)} must be [B, N, V] with [B, N] = {tuple(draft.tokens.shape)}")
    if draft.q is not None and draft.q_ids is None and draft.q.shape[-1] != scores.shape[-1]:
        raise ValueError(f"draft.q vocab {draft.q.shape[-1]} != target vocab {scores.shape[-1]}")


# --------------------------------------------------------------------------- greedy


def verify_greedy_chain(draft: Draft, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy verification when ``draft.parents`` is a chain (node ``i``'s parent is ``i - 1``)."""
    _check(draft, target_logits)
    B, N = draft.tokens.shape
    am = argmax(target_logits)  # [B, N]
    match = draft.tokens[:, 1:] == am[:, :-1]
    accept_len = match.long().cumprod(1).sum(1)  # longest matching prefix
    next_token = am.gather(1, accept_len.view(B, 1)).squeeze(1)
    ar = torch.arange(N, device=am.device).expand(B, N)
    path = torch.where(ar <= accept_len.view(B, 1), ar, torch.full_like(ar, -1))
    return VerifyResult(accept_len, path, next_token)


def verify_greedy_tree(draft: Draft, target_logits: torch.Tensor) -> VerifyResult:
    """Greedy verification of a general tree: the deepest node whose whole path matches the
    target argmax (ties: lowest index), then the argmax after it."""
    _check(draft, target_logits)
    B, N = draft.tokens.shape
    parents = draft.parents
    par = parents.clamp(min=0)  # the root points at itself; it always matches
    am = argmax(target_logits)
    match = draft.tokens == am.gather(1, par)
    match[:, 0] = True
    depths = tree_depths(parents)
    D = int(depths.max())
    accepted = match
    for _ in range(D):  # propagate acceptance one level per step
        accepted = match & accepted.gather(1, par)
    # deepest accepted node, lowest index among equals: depth dominates, then reversed index
    key = torch.where(accepted, depths * N + (N - 1 - torch.arange(N, device=am.device)), torch.full_like(depths, -1))
    last = key.argmax(1)
    accept_len = depths.gather(1, last.view(B, 1)).squeeze(1)
    next_token = am.gather(1, last.view(B, 1)).squeeze(1)
    return VerifyResult(accept_len, _path(parents, depths, last, D), next_token)


# --------------------------------------------------------------------------- sampling


def verify_sampling_chain(draft: Draft, target_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> VerifyResult:
    """Rejection sampling along a chain, fully vectorised over depth.

    ``target_probs`` ``[B, N, V]`` are already-processed target distributions. Consumes the
    same random numbers as :func:`verify_sampling_tree` on the same chain (on CPU the two agree
    exactly for a given generator state).
    """
    _check(draft, target_probs)
    draft = _over_target_vocab(draft, target_probs.shape[-1])
    B, N = draft.tokens.shape
    k, V = N - 1, target_probs.shape[-1]
    p = target_probs
    if k == 0:  # a plain step: nothing to accept, the same single draw as the general path below
        zeros = torch.zeros(B, dtype=torch.long, device=p.device)
        return VerifyResult(zeros, zeros.view(B, 1), sample(p[:, 0], generator))
    x = draft.tokens[:, 1:]
    px = p[:, :-1].gather(-1, x.unsqueeze(-1)).squeeze(-1)  # p_{i-1}(x_i), [B, k]
    if draft.q is None:
        qx = torch.ones_like(px)
    else:
        qx = draft.q[:, 1:].to(p.dtype).gather(-1, x.unsqueeze(-1)).squeeze(-1)
    # [k, B] then transpose: the tree verifier draws B uniforms per depth, in this order
    u = torch.rand(k, B, generator=generator, device=p.device, dtype=p.dtype).T
    accept = u * qx < px  # u < min(1, p/q), written without dividing by q
    accept_len = accept.long().cumprod(1).sum(1)
    p_last = _gather_nodes(p, accept_len)
    rejected = accept_len < k
    rej_node = (accept_len + 1).clamp(max=k)
    q_rej = _proposal(draft, rej_node, draft.tokens.gather(1, rej_node.view(B, 1)).squeeze(1), V, p.dtype)
    dist = torch.where(rejected.view(B, 1), _residual(p_last, q_rej), p_last)
    next_token = sample(dist, generator)
    ar = torch.arange(N, device=p.device).expand(B, N)
    path = torch.where(ar <= accept_len.view(B, 1), ar, torch.full_like(ar, -1))
    return VerifyResult(accept_len, path, next_token)


def verify_sampling_tree(draft: Draft, target_probs: torch.Tensor,
                         generator: torch.Generator | None = None) -> VerifyResult:
    """Recursive rejection sampling over a tree (any per-row structure).

    At node ``u`` with current distribution ``p`` the children are tried in index order; child
    ``c`` (token ``x``, proposal ``q_c``) is accepted with probability ``min(1, p(x) / q_c(x))``;
    on rejection ``p <- normalise(max(p - q_c, 0))``. Lossless provided each ``q_c`` is the
    distribution ``x`` was really drawn from given the earlier siblings (see ``Draft.q``).
    """
    _check(draft, target_probs)
    draft = _over_target_vocab(draft, target_probs.shape[-1])
    B, N = draft.tokens.shape
    dtype, dev = target_probs.dtype, target_probs.device
    children = _children_table(draft.parents)
    R = children.shape[-1]
    depths = tree_depths(draft.parents)
    D = int(depths.max())
    tokens = draft.tokens
    q_all = None if draft.q is None else draft.q.to(dtype)
    # q_c(x_c) for every node; deterministic proposals put all mass on x_c
    qx_all = (torch.ones(B, N, dtype=dtype, device=dev) if q_all is None
              else q_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
    u = torch.zeros(B, dtype=torch.long, device=dev)
    p = target_probs[:, 0]
    active = torch.ones(B, dtype=torch.bool, device=dev)  # rows still descending
    for _ in range(D):
        moved = torch.zeros_like(active)
        kids = _gather_nodes(children, u)  # [B, R], taken before u changes this level
        for r in range(R):
            c = kids[:, r]
            trying = active & ~moved & (c >= 0)
            c0 = c.clamp(min=0).view(B, 1)
            x = tokens.gather(1, c0)
            px = p.gather(1, x).squeeze(1)
            qx = qx_all.gather(1, c0).squeeze(1)
            # one uniform per row per (level, rank), drawn even for idle rows: the stream a row
            # sees must not depend on what other rows did
            acc = trying & (torch.rand(B, generator=generator, device=dev, dtype=dtype) * qx < px)
            rej = trying & ~acc
            if q_all is None:
                # residual of a one-hot proposal: p with x removed, renormalised
                q = torch.zeros_like(p).scatter_(1, x, 1.0)
            else:
                q = _gather_nodes(q_all, c0.squeeze(1))
            p = torch.where(rej.view(B, 1), _residual(p, q), p)
            u = torch.where(acc, c0.squeeze(1), u)
            moved |= acc
        active &= moved
        p = torch.where(moved.view(B, 1), _gather_nodes(target_probs, u), p)
    next_token = sample(p, generator)
    accept_len = depths.gather(1, u.view(B, 1)).squeeze(1)
    return VerifyResult(accept_len, _path(draft.parents, depths, u, D), next_token)


# --------------------------------------------------------------------------- dispatch


def _sampling_chain_in_c(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams,
                         generator: torch.Generator | None) -> VerifyResult | None:
    """:func:`verify_sampling_chain` of one sequence with temperature-only sampling in one C call
    (:mod:`.cpu_verify`: the same rule and random numbers, ~0.8 -> ~0.1 ms per step), or None."""
    q = None if draft.q is None else draft.q[0]
    out = cpu_verify.sampling_chain(draft.tokens[0], q, target_logits[0], sampling.temperature, generator, draft.q_ids)
    if out is None:
        return None
    accepted, nxt = out
    N = draft.tokens.shape[1]
    # the path built on the host: one tensor op, not four (they run on caches a forward just flushed)
    return VerifyResult(torch.tensor([accepted]), torch.tensor([list(range(accepted + 1)) + [-1] * (N - 1 - accepted)]),
                        torch.tensor([nxt]), host=(accepted, list(range(accepted + 1)), nxt))


def _greedy_one(draft: Draft, target_logits: torch.Tensor) -> VerifyResult:
    """:func:`verify_greedy_tree` (chains included) for one sequence, walked over Python lists: a
    handful of nodes, where the vectorised version's ~20 small tensor ops cost ~0.3 ms per step right
    after a forward (docs/results.md, twenty-fourth session)."""
    am = argmax(target_logits)[0].tolist()
    toks, par = draft.lists()
    depth, ok, best = [0] * len(toks), [True] * len(toks), 0
    for i in range(1, len(toks)):
        p = par[i]
        depth[i] = depth[p] + 1
        ok[i] = ok[p] and toks[i] == am[p]
        if ok[i] and depth[i] > depth[best]:  # the deepest, lowest index among equals
            best = i
    path, node = [], best
    while node >= 0:
        path.append(node)
        node = par[node]
    path = path[::-1]
    dev = draft.tokens.device
    return VerifyResult(torch.tensor([depth[best]], device=dev),
                        torch.tensor([path + [-1] * (max(depth) - depth[best])], device=dev),
                        torch.tensor([am[best]], device=dev), host=(depth[best], path, am[best]))


def verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | None = None) -> VerifyResult:
    """Verify ``draft`` against raw target logits ``[B, N, V]`` under ``sampling``.

    Greedy params use exact argmax matching; otherwise the target logits go through the same
    :func:`probs_from_logits` as the drafts' ``q`` and rejection sampling is applied.
    """
    _check(draft, target_logits)
    one = draft.tokens.shape[0] == 1
    if sampling.greedy and one:
        return _greedy_one(draft, target_logits)
    N = draft.tokens.shape[1]
    chain = N == 1 or (draft.parents[0].tolist() == list(range(-1, N - 1)) if one else _is_chain(draft.parents))
    if sampling.greedy:
        return (verify_greedy_chain if chain else verify_greedy_tree)(draft, target_logits)
    if chain and one and (sampling.top_k is None or sampling.top_k >= target_logits.shape[-1]) \
            and (sampling.top_p is None or sampling.top_p >= 1.0):
        done = _sampling_chain_in_c(draft, target_logits, sampling, generator)
        if done is not None:
            return done
    probs = probs_from_logits(target_logits, sampling)
    return (verify_sampling_chain if chain else verify_sampling_tree)(draft, probs, generator)
