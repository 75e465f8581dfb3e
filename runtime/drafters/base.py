"""The drafter interface and the registry keyed by the type string stored in checkpoints.

Protocol (one sequence per batch row; the generator serves ``B == 1``):

1. ``begin(prompt_ids, features)``: a new sequence. ``prompt_ids`` ``[B, L]``; the target has
   prefilled ``prompt_ids[:, :-1]`` and ``features`` ``[B, L-1, F, H]`` are the target hidden
   states (layers ``feature_layers``) of those tokens, or None when ``feature_layers`` is empty.
   The last prompt token is the *root*: committed, but not yet seen by the target.
2. ``propose(ctx) -> Draft``: a tree rooted at ``ctx.tokens[:, -1]`` with at most
   ``ctx.max_depth`` levels below the root and at most ``ctx.max_nodes`` nodes in total.
   In sampling mode (``not ctx.sampling.greedy``) every draft token must really be drawn from
   the distribution recorded for it in ``Draft.q`` (processed by the same
   :func:`~specfoundry.runtime.sampling.probs_from_logits` as the target); whether a node gets
   children may depend on anything already drawn, but a node's own value must not decide
   whether it is kept. In greedy mode any deterministic choice is fine.
3. ``commit(new_tokens, features)``: the verified continuation. ``new_tokens`` ``[B, n]`` are
   the accepted draft tokens followed by the bonus token (the new root); ``features``
   ``[B, n, F, H]`` are the target hidden states of the old root and the accepted drafts
   (so features are always known for every committed token but the last), or None.

Invariant: after ``begin``/``commit`` the drafter has seen features for ``tokens[:, :-1]``.

Optional: ``pre_draft(tokens, max_depth, root_id=None) -> Draft | None``, asked before the adaptive controller
each step; a Draft it returns is verified whatever shape the controller would have chosen, and the
controller neither chooses nor learns from that step (for cheap, deterministic drafts that need no
model forward: :class:`~.lookup.LookupFirstDrafter`'s prompt lookup). It may read only committed
tokens. ``commit`` follows as for any step.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..sampling import SamplingParams
from ..tree import Draft


@dataclass
class DraftContext:
    tokens: torch.Tensor  # [B, L] all committed tokens; tokens[:, -1] is the root
    sampling: SamplingParams
    max_depth: int
    max_nodes: int
    generator: torch.Generator | None = None
    root_id: int | None = None  # tokens[0, -1] as a host int, where the caller has it (saves a tensor read)

    def root(self) -> int:
        """The root token's id (``tokens[0, -1]``) of a one-sequence context."""
        return int(self.tokens[0, -1]) if self.root_id is None else self.root_id


class Drafter(ABC):
    """Proposes draft trees for one target. Subclasses register a ``type`` string."""

    type: ClassVar[str] = ""
    #: target hidden-state indices (HF ``hidden_states`` numbering: 0 = embeddings,
    #: i = input of layer i, L = final normed output) this drafter needs.
    feature_layers: tuple[int, ...] = ()
    #: the natural depth / node budget of this drafter (the generator may lower them).
    default_depth: int = 5
    default_nodes: int = 6
    #: whether the generator's adaptive controller is on when its caller does not say (a trained
    #: head's measured runtime shape may be a fixed one: runtime/tune.py)
    default_adaptive: bool = True

    def fork(self) -> "Drafter":
        """A drafter for another sequence: shares this one's weights and options, gets its own
        per-sequence state from :meth:`begin` (which every drafter (re)creates there). The
        serving scheduler keeps one fork per active sequence."""
        return copy.copy(self)

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None: ...

    @abstractmethod
    def propose(self, ctx: DraftContext) -> Draft: ...

    @abstractmethod
    def commit(self, new_tokens: torch.Tensor, features: torch.Tensor | None) -> None: ...


# type string -> factory(source, target, **options) -> Drafter, where ``source`` is None for
# model-free drafters or a checkpoint directory / model path.
DRAFTER_REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register_drafter(type_name: str):
    def deco(factory):
        if type_name in DRAFTER_REGISTRY:
            raise ValueError(f"drafter type {type_name!r} registered twice")
        DRAFTER_REGISTRY[type_name] = factory
        return factory

    return deco
