"""The reduced draft vocabulary shared by EAGLE-3 and reduced-vocabulary Medusa heads.

Scope: writing a head's ``d2t`` (draft id -> target id) and ``t2d`` (bool mask over the target
vocabulary) buffers from a list of target ids, with the checks every head applies. Reading and
validating them from a checkpoint is ``tensor_problems`` on the head classes.
"""

from __future__ import annotations

import torch


def set_draft_vocab(d2t: torch.Tensor, t2d: torch.Tensor, token_ids, vocab_size: int) -> None:
    """Fill ``d2t``/``t2d`` in place from ``token_ids``: ``d2t.numel()`` distinct target ids in
    ``[0, vocab_size)``; one ValueError otherwise."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).view(-1).to(d2t.device)
    if ids.numel() != d2t.numel():
        raise ValueError(f"need {d2t.numel()} draft token ids, got {ids.numel()}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"draft token ids must lie in [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("draft token ids must be distinct")
    d2t.copy_(ids)
    t2d.zero_()
    t2d[ids] = True
