"""Batched EAGLE chain drafting for the serving batch: one head forward per depth for all rows.

Scope: the EAGLE/EAGLE-3 head's per-row state in the serving engine (its KV, the committed pairs
not yet run, the root's head output) and the chain proposals of every speculating row in one
step; the scheduler (:mod:`.scheduler`) decides who speculates and how deep.

Per request, :class:`~specfoundry.runtime.drafters.eagle.EagleDrafter` runs the head on batch 1:
a step with ``B`` speculating rows ran ``B`` head forwards per depth (each ~1 ms on a CPU, most
of it fixed cost), so at 8 rows drafting cost about as much as verifying. Here the head's KV for
all rows lives in one ``[2, slots, hkv, capacity, D]`` tensor with a length per row (the layout
of :class:`~.slots.SlotCache`), and each depth is one
:meth:`~specfoundry.runtime.speculators.eagle._EagleBase.step_rows` over the speculating rows.

What a row computes is what the per-request drafter computes for a chain (same pairs, positions
and greedy choice: tested against it), so this changes only the cost of drafting; every token
the server emits still comes from the verifier.

- ``begin``: the prompt's pairs are queued (target features kept raw), not run: a request the
  policy keeps plain (under load, most of them) never pays the head's pass over its prompt
  (measured at 16 clients: ~4% of the server's time, run for every request);
- ``commit``: the verified continuation's pairs are queued likewise; the next ``propose`` that
  includes the row fuses and runs every row's queue in one forward, padded to the longest
  (padding sits after a row's real pairs, so causal attention never reads it, and it is
  overwritten later), except that a row with more than :data:`LONG_QUEUE` pairs pending (its
  prompt, or a long plain stretch) catches up alone (no row pads to a prompt's length); the
  seconds of those catch-ups are counted in :attr:`SlotDrafts.catchup_seconds` (a once-per-request
  cost the policy must not read as a drafting cost);
- ``propose``: greedy rows take the argmax, sampling rows draw from their processed draft
  distribution (at the drafter's ``draft_temperature`` multiple of the row's temperature) with their
  own generator (``Draft.q`` records it), one token per depth.
"""

from __future__ import annotations

import time

import torch

from ..sampling import SamplingParams, draft_params, probs_from_logits, sample, tree_log_probs
from ..drafters.eagle import PROMPT_WINDOW, prompt_pairs, topk_first
from ..tree import Draft, over_target_vocab, subtree

__all__ = ["LONG_QUEUE", "SlotDrafts"]

#: pending pairs above which a row catches its head up alone (see the module doc)
LONG_QUEUE = 32


class SlotDrafts:
    """The head state of up to ``slots`` rows of at most ``capacity`` pairs (see the module doc).
    Rows mirror the serving :class:`~.slots.SlotCache`: the caller adds, commits and removes
    them in the same order."""

    def __init__(self, head, slots: int, capacity: int, draft_temperature: float = 1.0,
                 prompt_window: int = PROMPT_WINDOW):
        if not (hasattr(head, "step_rows") and hasattr(head, "fuse_features")):
            raise TypeError(f"{type(head).__name__} has no batched drafting step")
        a = head.architecture
        self.head = head
        self.draft_temperature = draft_temperature  # the drafter's (EagleDrafter.draft_temperature)
        self.prompt_window = prompt_window  # and its EagleDrafter.prompt_window
        with torch.inference_mode():
            self.kv = torch.zeros(2, slots, a["num_key_value_heads"], capacity, a["head_dim"], dtype=head.dtype,
                                  device=head.device)
        self.lengths = [0] * slots
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(slots)]
        self._root: list[torch.Tensor | None] = [None] * slots  # head output of the root's pair [H]
        self.catchup_seconds = 0.0  # spent running rows' long queues alone (prompts)

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    # -- rows ------------------------------------------------------------------------------
    @torch.inference_mode()
    def begin(self, row: int, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """Row ``row`` starts a sequence: ``prompt_ids`` ``[1, L]``, ``features`` ``[1, L-1, F, H]``
        of the prefilled ``prompt_ids[:, :-1]`` (see the drafter protocol)."""
        self.lengths[row], self._pending[row], self._root[row] = 0, [], None
        if prompt_ids.shape[1] > 1:  # (the drafter's last prompt_window pairs) run when the row first drafts
            self._queue(row, *prompt_pairs(prompt_ids, features, self.prompt_window))

    @torch.inference_mode()
    def commit(self, row: int, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """The verified continuation ``new_tokens`` ``[1, n]`` and the target features ``[1, n, F, H]``
        of the old root and the accepted drafts."""
        self._queue(row, new_tokens, features)

    def remove(self, row: int, last: int) -> None:
        """Mirror :meth:`~.slots.SlotCache.remove`: row ``last`` (the last active one) moves into
        ``row`` (nothing moves when they are equal)."""
        if row == last:
            self._pending[row], self._root[row] = [], None
            return
        n = self.lengths[last]
        with torch.inference_mode():
            self.kv[:, row, :, :n] = self.kv[:, last, :, :n]
        self.lengths[row], self._pending[row], self._root[row] = n, self._pending[last], self._root[last]
        self._pending[last], self._root[last] = [], None

    def _queue(self, row: int, next_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        n = next_ids.shape[1]
        if n == 0:
            return
        if features is None or features.shape[1] != n:
            raise ValueError(f"need target features for the {n} new pairs")
        # kept raw ([n, F, H]) and fused when the row next drafts, for every drafting row at once: a
        # request the policy keeps plain costs nothing here
        self._pending[row].append((next_ids[0].to(self.head.device), features[0]))

    def _run(self, rows: list[int]) -> None:
        """Run the queued pairs of ``rows`` and commit them: rows with more than
        :data:`LONG_QUEUE` pending alone, the others in one forward padded to the longest."""
        rows = [r for r in rows if self._pending[r]]
        long = [r for r in rows if sum(i.shape[0] for i, _ in self._pending[r]) > LONG_QUEUE]
        if long:
            t0 = time.perf_counter()
            for r in long:
                self._run_together([r])
            self.catchup_seconds += time.perf_counter() - t0
        short = [r for r in rows if r not in long]
        if short:
            self._run_together(short)

    def _run_together(self, rows: list[int]) -> None:
        """One forward over the queued pairs of ``rows`` (padded to the longest)."""
        ids = [torch.cat([i for i, _ in self._pending[r]]) for r in rows]
        counts = [x.shape[0] for x in ids]
        n = max(counts)
        if any(self.lengths[r] + n > self.capacity for r in rows) and len(rows) > 1:
            for r in rows:  # the padding would not fit one of them: run each alone
                self._run_together([r])
            return
        fused = self.head.fuse_features(torch.cat([f for r in rows for _, f in self._pending[r]]).unsqueeze(0))[0]
        hid = list(fused.split(counts))
        H = hid[0].shape[-1]
        dev = self.head.device
        ids_b = torch.zeros(len(rows), n, dtype=torch.long, device=dev)
        hid_b = torch.zeros(len(rows), n, H, dtype=hid[0].dtype, device=dev)
        for b, (i, h) in enumerate(zip(ids, hid)):
            ids_b[b, : i.shape[0]] = i
            hid_b[b, : h.shape[0]] = h
        out = self.head.step_rows(ids_b, hid_b, self.kv, torch.tensor(rows, device=dev),
                                  torch.tensor([self.lengths[r] for r in rows], device=dev))
        for b, (r, c) in enumerate(zip(rows, counts)):
            self.lengths[r] += c
            self._root[r] = out[b, c - 1]
            self._pending[r] = []

    # -- proposals -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, rows: list[int], roots: list[torch.Tensor], depth: int, sampling: list[SamplingParams],
                generators: list[torch.Generator | None], nodes: int | None = None, top_k: int = 4) -> list[Draft]:
        """A chain of ``depth`` drafts below each root (``roots[i]``: row ``rows[i]``'s last committed
        token); a row whose head has no output yet (a one-token prompt) gets the root alone.
        ``nodes`` > ``depth + 1`` (greedy rows only): a tree of that many nodes (:meth:`_trees`)."""
        tree = nodes is not None and nodes > depth + 1
        if tree and not all(sp.greedy for sp in sampling):
            raise ValueError("draft trees in serving are greedy only: sampling rows draft chains")
        if depth < 1 or not rows:
            return [Draft.root_only(r.view(-1)[-1:]) for r in roots]
        self._run(rows)
        live = [i for i, r in enumerate(rows) if self._root[r] is not None]
        if not live:
            return [Draft.root_only(r.view(-1)[-1:]) for r in roots]
        if tree:
            return self._trees(rows, roots, live, depth, nodes, top_k)
        if any(self.lengths[rows[i]] + depth - 1 > self.capacity for i in live):
            raise ValueError(f"a row's draft would exceed the drafting cache ({self.capacity} entries)")
        head = self.head
        d2t = head.draft_to_target
        dev = head.device
        rows_t = torch.tensor([rows[i] for i in live], device=dev)
        base = torch.tensor([self.lengths[rows[i]] for i in live], device=dev)
        h = torch.stack([self._root[rows[i]] for i in live]) if live else None
        tokens: list[torch.Tensor] = []  # per depth [R] target ids
        qs: list[list[torch.Tensor | None]] = []
        greedy = [sampling[i].greedy for i in live]
        for d in range(depth):
            logits = head.compute_logits(h)  # [R, Vd]
            tok = logits.argmax(-1)  # greedy rows; sampling rows draw below
            q_d: list[torch.Tensor | None] = [None] * len(live)
            if not all(greedy):
                for j, i in enumerate(live):
                    if not greedy[j]:
                        q = probs_from_logits(logits[j: j + 1], draft_params(sampling[i], self.draft_temperature))[0]  # draft vocabulary
                        tok[j] = sample(q, generators[i])
                        q_d[j] = q
            target_tok = tok if d2t is None else d2t[tok]
            tokens.append(target_tok)
            qs.append(q_d)
            if d + 1 < depth:  # the next depth reads this draft: one entry per row past its committed pairs
                h = head.step_rows(target_tok.view(-1, 1), h.view(len(live), 1, -1), self.kv, rows_t, base + d)[:, 0]
        V = head.architecture["vocab_size"]

        def chain(j: int, root: torch.Tensor) -> Draft:
            q = None
            if not greedy[j]:
                qd = torch.stack([qs[d][j] for d in range(depth)])  # [depth, Vd]
                q = qd if d2t is None else over_target_vocab(qd, d2t, V)
                q = q.unsqueeze(0)
            return Draft.chain(root.to(dev), torch.stack([t[j] for t in tokens]).view(1, depth), q)

        return _assemble(roots, live, chain)

    def _trees(self, rows: list[int], roots: list[torch.Tensor], live: list[int], depth: int, nodes: int,
               top_k: int) -> list[Draft]:
        """Greedy EAGLE-2 trees for the ``live`` rows at once: what the per-request drafter's tree
        search (``EagleDrafter._grow_greedy``) builds for each row, with one head forward per depth
        for all rows (every row expands the same number of nodes per depth, so the frontier is a
        tensor)."""
        head = self.head
        d2t = head.draft_to_target
        dev = head.device
        R, k = len(live), min(top_k, head.draft_vocab_size)
        if any(self.lengths[rows[i]] + k * (depth - 1) > self.capacity for i in live):
            raise ValueError(f"a row's draft would exceed the drafting cache ({self.capacity} entries)")
        rows_t = torch.tensor([rows[i] for i in live], device=dev)
        base = torch.tensor([self.lengths[rows[i]] for i in live], device=dev)
        front_h = torch.stack([self._root[rows[i]] for i in live]).unsqueeze(1)  # [R, m, H]
        # scores only rank candidates: float32 (or the head's float64 in tests), as the per-request search
        work = torch.promote_types(front_h.dtype, torch.float32)
        front_score = torch.zeros(R, 1, dtype=work, device=dev)
        front_idx = torch.zeros(R, 1, dtype=torch.long, device=dev)  # node ids (0 = root)
        front_rows = torch.zeros(R, 1, 0, dtype=torch.bool, device=dev)  # ancestors among the draft entries
        tokens, parents, scores = [], [], []  # per depth [R, m*k]
        n_nodes, written = 1, 0
        for d in range(1, depth + 1):
            m = front_h.shape[1]
            # ranked as the per-request search ranks (its C log-probabilities, ties by index)
            logp = tree_log_probs(head.compute_logits(front_h.reshape(R * m, -1)), work)
            top_v, top_i = topk_first(logp.view(R, m, -1), k)  # [R, m, k]
            child_tok = (top_i if d2t is None else d2t[top_i]).reshape(R, m * k)
            child_score = (front_score[:, :, None] + top_v).reshape(R, m * k)
            tokens.append(child_tok)
            parents.append(front_idx.repeat_interleave(k, dim=1))
            scores.append(child_score)
            child_idx = n_nodes + torch.arange(m * k, device=dev)
            n_nodes += m * k
            if d == depth:
                break
            sel = topk_first(child_score, min(k, m * k))[1].sort(dim=-1).values  # [R, e]
            par = sel // k
            e = sel.shape[1]
            anc = torch.gather(front_rows, 1, par[:, :, None].expand(R, e, written))
            front_rows = torch.cat([anc, torch.eye(e, dtype=torch.bool, device=dev).expand(R, e, e)], dim=2)
            hid = torch.gather(front_h, 1, par[:, :, None].expand(R, e, front_h.shape[2]))
            pos = (base + d - 1).view(R, 1).expand(R, e)
            front_h = head.step_rows(torch.gather(child_tok, 1, sel), hid, self.kv, rows_t, base + written,
                                     position_ids=pos, block=front_rows)
            written += e
            front_idx, front_score = child_idx[sel], torch.gather(child_score, 1, sel)
        tok, par_all, score = torch.cat(tokens, dim=1), torch.cat(parents, dim=1), torch.cat(scores, dim=1)
        budget = min(nodes - 1, tok.shape[1])

        def tree(j: int, root: torch.Tensor) -> Draft:
            # the best `budget` nodes; the stable sort breaks ties by index (parents first)
            keep = torch.sort(-score[j], stable=True).indices[:budget].sort().values
            return subtree(root.to(dev), tok[j], par_all[j], keep, None)

        return _assemble(roots, live, tree)


def _assemble(roots: list[torch.Tensor], live: list[int], make) -> list[Draft]:
    """One draft per root: ``make(j, root)`` for the ``j``-th live row, the root alone for a row
    whose head has no output yet."""
    by_row = {i: j for j, i in enumerate(live)}
    drafts = []
    for i, root in enumerate(roots):
        root = root.view(-1)[-1:]
        j = by_row.get(i)
        drafts.append(Draft.root_only(root) if j is None else make(j, root))
    return drafts
