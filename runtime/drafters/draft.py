"""Draft-model drafter (``draft``): any causal LM sharing the target's tokenizer.

The draft model runs through the same :class:`~specfoundry.runtime.target.TargetModel`
adapter as the target, with its own KV cache: it holds committed tokens only, and whatever
a proposal appended beyond the accepted path is cropped at commit.
"""

from __future__ import annotations

import torch

from ..adaptive import MAX_DRAFT_DEPTH, check_int
from ..sampling import argmax, probs_from_logits, sample
from ..target import TargetModel
from ..tree import Draft
from .base import DraftContext, Drafter, register_drafter


class DraftModelDrafter(Drafter):
    type = "draft"

    def __init__(self, draft: TargetModel, target: TargetModel | None = None, depth: int = 4):
        if target is not None and draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({draft.vocab_size}) differs from the target's ({target.vocab_size}); "
                "a draft model must share the target's tokenizer"
            )
        if target is not None and draft.tokenizer is not None and target.tokenizer is not None:
            if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
                raise ValueError("draft model tokenizer differs from the target's tokenizer")
        self.lm = draft
        depth = check_int("depth", depth, 1, MAX_DRAFT_DEPTH)
        self.default_depth = depth
        self.default_nodes = depth + 1
        self.cache = None
        self._tokens: torch.Tensor | None = None

    def begin(self, prompt_ids: torch.Tensor, features=None) -> None:
        self.cache = self.lm.new_cache()
        self._tokens = prompt_ids.to(self.lm.device)

    def propose(self, ctx: DraftContext) -> Draft:
        k = min(ctx.max_depth, ctx.max_nodes - 1)
        root = ctx.tokens[:, -1]
        if k <= 0:
            return Draft.root_only(root)
        committed = self.cache.length
        # feed what the draft cache has not seen yet (at least the root), then k-1 drafts
        feed = self._tokens[:, committed:]
        drafts, qs = [], []
        for step in range(k):
            out = self.lm.forward(feed, self.cache, logits_for=torch.tensor([feed.shape[1] - 1]))
            self.cache.commit()
            logits = out.logits[:, -1]
            if ctx.sampling.greedy:
                tok = argmax(logits)
            else:
                q = probs_from_logits(logits, ctx.sampling)
                tok = sample(q, ctx.generator)
                qs.append(q)
            drafts.append(tok)
            feed = tok.view(-1, 1)
        # the cache now holds the root and drafts[:-1] beyond the committed prefix (cropped at commit)
        q = torch.stack(qs, dim=1) if qs else None
        return Draft.chain(root.to(self.lm.device), torch.stack(drafts, dim=1), q)

    def commit(self, new_tokens: torch.Tensor, features=None) -> None:
        new_tokens = new_tokens.to(self.lm.device)
        # valid cache entries: committed tokens before the root, the root, accepted drafts
        valid = self._tokens.shape[1] + new_tokens.shape[1] - 1
        self._tokens = torch.cat([self._tokens, new_tokens], dim=1)
        if self.cache.length > valid:
            self.cache.crop(valid)


@register_drafter("draft")
def _make_draft(source, target, device=None, dtype=None, **options) -> DraftModelDrafter:
    from ..models import load_target

    if source is None:
        raise ValueError("the draft drafter needs a model: a local HF directory or a built-in target name")
    if isinstance(source, TargetModel):
        lm = source
    else:
        lm = load_target(str(source), device=device or target.device, dtype=dtype or target.dtype)
        for name, t in lm.model.state_dict().items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{source}: draft model tensor {name!r} holds non-finite values (NaN/inf); "
                                 "refusing to draft with corrupt weights")
    return DraftModelDrafter(lm, target, **options)


def layer_subset_model(target: TargetModel, layers: list[int]) -> TargetModel:
    """A smaller causal LM made of some of ``target``'s decoder layers plus its embeddings, final
    norm and LM head: a draft model sharing the tokenizer (and the usual initialisation for
    distilling one)."""
    import copy

    if not layers or any(not 0 <= i < target.num_layers for i in layers):
        raise ValueError(f"layers must be a non-empty subset of 0..{target.num_layers - 1}, got {layers}")
    cfg = copy.deepcopy(target.model.config)
    cfg.num_hidden_layers = len(layers)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in layers]
    model = type(target.model)(cfg).to(target.dtype)
    src = target.model.state_dict()
    state = {}
    for key, value in src.items():
        if key.startswith("model.layers."):
            idx, rest = key[len("model.layers."):].split(".", 1)
            if int(idx) in layers:
                state[f"model.layers.{layers.index(int(idx))}.{rest}"] = value
        else:
            state[key] = value
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    from ..models import wrap_target

    backend = "hf" if type(target) is TargetModel else "auto"  # the draft runs on the target's path
    return wrap_target(model.to(target.device), target.tokenizer, name=f"{target.name}-layers{len(layers)}", backend=backend)
