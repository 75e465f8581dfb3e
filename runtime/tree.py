"""Draft trees: the one representation every drafter proposes and every verifier reads.

A :class:`Draft` is a batch of token trees in topological order. Node 0 is the *root*: the
last committed token, whose KV is not yet in the target cache. A chain of ``k`` drafts is a
tree whose node ``i`` has parent ``i - 1``. The target scores all nodes in one forward with
the mask :func:`ancestor_matrix` and positions ``past_len + depth``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def over_target_vocab(q: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Distributions ``q`` ``[..., Vq]`` over a draft vocabulary (column ``j`` is target id ``ids[j]``) as
    ``[..., vocab_size]`` over the target's, zero at every other id (where verification compares q with p)."""
    return q.new_zeros(*q.shape[:-1], vocab_size).index_copy_(q.dim() - 1, ids.to(q.device), q)


@dataclass
class Draft:
    """A batch of draft trees.

    tokens:  ``[B, N]`` long; ``tokens[:, 0]`` is the root (last committed token).
    parents: ``[B, N]`` long; ``parents[:, 0] == -1`` and ``parents[b, i] < i``.
    q:       ``[B, N, V]`` float or None. ``q[b, i]`` is the distribution node ``i``'s token was
             drawn from, given its earlier siblings (for sampling without replacement it is the
             parent's draft distribution with earlier siblings zeroed and renormalised).
             ``None`` means deterministic proposals (a one-hot at each token); ``q[:, 0]`` is unused.
    q_ids:   ``[Vq]`` long or None: ``q``'s last dimension spans a draft vocabulary, column ``j`` the
             target id ``q_ids[j]`` (``q`` is zero at every other id; :meth:`target_q` spreads it out).
             Why: a head's 2k-entry draft vocabulary spread over a 49k target vocabulary is ~0.6 MB of
             zeros written per sampled step, where the C verifier reads the draft vocabulary's entries only.
    host:    one sequence's ``(tokens, parents)`` as Python lists, when its drafter had them without a
             tensor op (or after :meth:`lists` read them): the generator's bookkeeping reads these.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor | None = None
    host: tuple[list[int], list[int]] | None = field(default=None, repr=False, compare=False)
    q_ids: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 2:
            raise ValueError(f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must both be [B, N]")
        if self.q is not None and self.q.shape[:2] != self.tokens.shape:
            raise ValueError(f"q {tuple(self.q.shape)} must be [B, N, V] with [B, N] = {tuple(self.tokens.shape)}")
        if self.q_ids is not None and (self.q is None or self.q_ids.dim() != 1 or self.q.shape[-1] != self.q_ids.shape[0]):
            raise ValueError(f"q_ids {tuple(self.q_ids.shape)} must be [Vq] for q [B, N, Vq], got q "
                             f"{None if self.q is None else tuple(self.q.shape)}")
        if self.host is not None and (self.tokens.shape[0] != 1 or len(self.host[0]) != self.tokens.shape[1]
                                      or len(self.host[1]) != self.tokens.shape[1]):
            raise ValueError(f"host lists of {len(self.host[0])} / {len(self.host[1])} entries for tokens "
                             f"{tuple(self.tokens.shape)} (one sequence's, one entry per node)")

    def lists(self) -> tuple[list[int], list[int]]:
        """A one-sequence draft's ``(tokens, parents)`` as Python lists: :attr:`host`, read from the
        tensors on the first call when the drafter did not attach them. Why: right after a forward
        every tensor op runs on caches the weight stream flushed (~10-40 us each, docs/results.md,
        thirty-first session), and a step's bookkeeping needs a handful of ints."""
        if self.host is None:
            if self.tokens.shape[0] != 1:
                raise ValueError(f"lists() is for one sequence, got a batch of {self.tokens.shape[0]}")
            self.host = (self.tokens[0].tolist(), self.parents[0].tolist())
        return self.host

    def target_q(self, vocab_size: int) -> torch.Tensor | None:
        """``q`` over the target vocabulary ``[B, N, vocab_size]`` (zero outside a draft vocabulary)."""
        if self.q is None or self.q_ids is None:
            return self.q
        return over_target_vocab(self.q, self.q_ids, vocab_size)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def depths(self) -> torch.Tensor:
        return tree_depths(self.parents)

    @staticmethod
    def chain(root: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None = None) -> "Draft":
        """A chain: ``root`` ``[B]``, ``drafts`` ``[B, k]``, optional ``q`` ``[B, k, V]`` for the drafts."""
        B, k = drafts.shape
        tokens = torch.cat([root.view(B, 1), drafts], dim=1)
        parents = torch.arange(-1, k, device=drafts.device).expand(B, k + 1).clone()
        if q is not None:
            q = torch.cat([torch.zeros_like(q[:, :1]), q], dim=1) if k else q.new_zeros(B, 1, q.shape[-1])
        return Draft(tokens, parents, q)

    @staticmethod
    def root_only(root: torch.Tensor, root_id: int | None = None) -> "Draft":
        """Just the root ``[B]`` (a plain step); ``root_id``: one sequence's root as a host int
        (:meth:`host_chain`: :attr:`host` set, two tensor ops instead of five)."""
        if root_id is None:
            return Draft.chain(root, root.new_zeros(root.shape[0], 0))
        return Draft.host_chain([root_id], root.device)

    @staticmethod
    def host_chain(ids: list[int], device: torch.device) -> "Draft":
        """One sequence's chain from host ids (the root first), with :attr:`host` set."""
        parents = list(range(-1, len(ids) - 1))
        return Draft(torch.tensor([ids], dtype=torch.long, device=device),
                     torch.tensor([parents], dtype=torch.long, device=device), host=(list(ids), parents))


def _jumps(n: int) -> int:
    """Pointer-jumping rounds that cover any path in an ``n``-node tree."""
    return max(1, (n - 1).bit_length())


def _small_lists(parents: torch.Tensor) -> list[int] | None:
    """One sequence's few-node tree in topological order as a list (its bookkeeping is cheaper over
    Python lists than as ~10 tensor ops, ~0.2 ms per step right after a forward; on a GPU one copy
    to the host instead of ~20 kernel launches), else None."""
    if parents.shape[0] != 1 or parents.shape[1] > 64:
        return None
    par = parents[0].tolist()
    return par if all(p < i for i, p in enumerate(par)) else None


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (root 0) for ``parents`` ``[B, N]`` in topological order.

    Pointer jumping (Wyllie's list ranking): ``log2 N`` vectorised rounds, not a loop over nodes.
    """
    par = _small_lists(parents)
    if par is not None:
        depth = [0] * len(par)
        for i, p in enumerate(par):
            depth[i] = depth[p] + 1 if p >= 0 else 0
        return torch.tensor([depth], dtype=torch.long, device=parents.device)
    depth = (parents >= 0).long()
    up = parents.clone()
    for _ in range(_jumps(parents.shape[1])):
        has = up >= 0
        idx = up.clamp(min=0)
        depth = depth + torch.where(has, depth.gather(1, idx), 0)
        up = torch.where(has, up.gather(1, idx), up)
    return depth


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """``[B, N, N]`` bool: ``m[b, i, j]`` is True when j is i or an ancestor of i (the tree
    attention mask of one verification forward). Transitive closure by ``log2 N`` squarings."""
    B, N = parents.shape
    par = _small_lists(parents)
    if par is not None:
        rows = []
        for i, p in enumerate(par):
            row = list(rows[p]) if p >= 0 else [False] * N
            row[i] = True
            rows.append(row)
        return torch.tensor([rows], dtype=torch.bool, device=parents.device)
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    step = torch.zeros(B, N, N + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(parents >= 0, parents, N).unsqueeze(-1), True)
    reach = (eye | step[..., :N]).float()  # self and parent
    for _ in range(_jumps(N)):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach.bool()


class TreeLayout(NamedTuple):
    """What a verification forward needs of one sequence's tree shape (shared tensors: read only)."""

    depth: tuple[int, ...]  # each node's depth (root 0)
    depths: torch.Tensor  # [1, N] long, the same
    mask: torch.Tensor | None  # [1, N, N] bool, :func:`ancestor_matrix`; None for a lone root
    max_depth: int


def tree_layout(parents: list[int], device: torch.device) -> TreeLayout:
    """:func:`tree_depths` and :func:`ancestor_matrix` of one sequence's ``parents`` (a list), made
    once per tree shape and device and then shared: a decoding loop meets a few shapes (its small
    trees, chains of each length) every step, and each tensor op right after a forward costs
    ~10-40 us (docs/results.md, thirty-first session). The returned tensors must not be modified."""
    return _layout(tuple(parents), device)


@functools.lru_cache(maxsize=1024)
def _layout(parents: tuple[int, ...], device: torch.device) -> TreeLayout:
    par = torch.tensor([parents], dtype=torch.long, device=device)
    depths = tree_depths(par)
    depth = tuple(depths[0].tolist())
    return TreeLayout(depth, depths, ancestor_matrix(par) if len(parents) > 1 else None, max(depth))


def path_to(parents: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """Node indices from the root to ``node`` for each batch row, padded with -1: ``[B, maxdepth+1]``."""
    depths = tree_depths(parents)
    d = depths.gather(1, node.view(-1, 1)).squeeze(1)
    max_d = int(depths.max()) if depths.numel() else 0
    B = parents.shape[0]
    out = torch.full((B, max_d + 1), -1, dtype=torch.long, device=parents.device)
    cur = node.clone()
    for step in range(max_d + 1):
        col = d - step
        valid = col >= 0
        out[valid, col[valid]] = cur[valid]
        cur = torch.where(valid, parents.gather(1, cur.view(-1, 1)).squeeze(1).clamp(min=0), cur)
    return out


def tree_from_choices(choices: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """Static tree (Medusa-style choices): each choice is a path of top-k ranks per depth.

    Returns ``parents`` ``[N]`` (root first, ordered by depth then choice) and the sorted
    choices list (``choices[i - 1]`` is node ``i``'s path). Missing prefixes are added.
    """
    paths = set()
    for c in choices:
        if not c or any((not isinstance(r, int)) or r < 0 for r in c):
            raise ValueError(f"tree choice {c!r} must be a non-empty list of non-negative ints")
        for d in range(1, len(c) + 1):
            paths.add(tuple(c[:d]))
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(ordered)}
    parents = [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in ordered]
    return torch.tensor(parents, dtype=torch.long), [list(p) for p in ordered]


def subtree(root: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, keep: torch.Tensor,
             q: torch.Tensor | None) -> Draft:
    """Assemble a Draft from candidate nodes ``1..M`` (``tok``/``par`` ``[M]``, parent ids in
    1-based node numbering with 0 = root) keeping ``keep`` (0-based candidate indices, sorted,
    ancestor-closed)."""
    dev = tok.device
    M = tok.shape[0]
    new_id = torch.full((M + 1,), -1, dtype=torch.long, device=dev)
    new_id[0] = 0
    new_id[keep + 1] = torch.arange(1, keep.shape[0] + 1, device=dev)
    new_par = new_id[par[keep]]
    if bool((new_par < 0).any()):
        raise AssertionError("draft tree selection is not closed under ancestors")
    tokens = torch.cat([root.view(1).to(dev), tok[keep]]).view(1, -1)
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev), new_par]).view(1, -1)
    if q is not None:
        q = torch.cat([q.new_zeros(1, q.shape[-1]), q[keep]]).unsqueeze(0)
    return Draft(tokens, parents, q)
