"""Target adapter: one HF causal LM behind the calls speculative decoding needs.

- :meth:`TargetModel.forward` runs new tokens (a chain or a tree) against a :class:`KVCache`
  with explicit position ids and a tree attention mask, returning logits and the hidden
  states of requested layers.
- :class:`KVCache` keeps committed tokens only: after a verification forward,
  :meth:`KVCache.commit` keeps the prefix plus the accepted (possibly non-contiguous) tree
  nodes and drops the rest.

The same adapter serves draft language models (the ``draft`` drafter).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .chat import encode_chat


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, n, V]
    features: torch.Tensor | None  # [B, n, F, H] hidden states of the requested layers


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool ``[B, n, S]`` (True = may attend) -> additive float ``[B, 1, n, S]``.

    An additive float mask works for both the sdpa and eager attention paths of transformers.
    """
    mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)


@functools.cache
def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


def hf_cache_kw(cache) -> dict:
    """``{name: cache}`` for a transformers model, decoder layer or attention call. transformers 5.24
    renamed the cache argument ``past_key_values`` to ``cache``; before it ``cache=`` lands in
    ``**kwargs`` and is ignored (no KV cache at all: found on a GPU machine with 5.17), so every
    call passes it under the name the installed version takes."""
    return {_cache_kwarg(): cache}


class KVCache:
    """A transformers ``DynamicCache`` plus commit/rollback of tree nodes."""

    def __init__(self):
        self.hf = DynamicCache()
        self.length = 0  # committed tokens
        self._pending = 0  # tokens appended by the last forward, not yet committed

    def _layers(self):
        return self.hf.layers

    def check_ready(self) -> None:
        """A forward may only run when nothing is pending."""
        if self._pending:
            raise RuntimeError("commit or roll back the previous forward before the next one")

    def mark_appended(self, n: int) -> None:
        """Record that a forward appended ``n`` entries, pending until :meth:`commit`."""
        self._pending = n

    def commit(self, keep: torch.Tensor | list[int] | None = None) -> None:
        """Keep the committed prefix plus the pending entries at ``keep`` (``[m]`` indices into
        the last forward's new tokens, in order, a tensor or a list); ``None`` keeps them all."""
        n = self._pending
        if keep is None:
            self.length += n
            self._pending = 0
            return
        keep = torch.as_tensor(keep, dtype=torch.long)
        m = int(keep.numel())
        contiguous = m == 0 or bool((keep == torch.arange(m, device=keep.device)).all())
        for layer in self._layers():
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            if contiguous:
                # the accepted path is a prefix of the new block: a view is enough
                layer.keys = layer.keys[..., : self.length + m, :]
                layer.values = layer.values[..., : self.length + m, :]
            else:
                idx = torch.cat([torch.arange(self.length, device=layer.keys.device), self.length + keep.to(layer.keys.device)])
                layer.keys = layer.keys.index_select(-2, idx)
                layer.values = layer.values.index_select(-2, idx)
        self.length += m
        self._pending = 0

    def rollback(self) -> None:
        """Drop everything the last forward appended."""
        self.commit(torch.zeros(0, dtype=torch.long))

    def crop(self, length: int) -> None:
        """Truncate the committed cache to ``length`` tokens."""
        if self._pending:
            self.rollback()
        for layer in self._layers():
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self.length = min(self.length, length)


class ChatTokenizerMixin:
    """Prompt encoding and decoding from ``self.tokenizer`` (None for tiny test models); shared
    by every object that stands in for a target (the PyTorch adapter, the ONNX Runtime one)."""

    tokenizer = None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation in the chat template, ending with the assistant header; message
        content is encoded as text, so it can never produce control tokens (:mod:`.chat`)."""
        if self.tokenizer is None:
            raise ValueError("this target has no tokenizer; pass prompt token ids instead")
        return encode_chat(self.tokenizer, messages, add_generation_prompt=True)

    def decode(self, ids) -> str:
        if self.tokenizer is None:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class TargetModel(ChatTokenizerMixin):
    """Wraps a HF causal LM (``model``) and its tokenizer (may be None for tiny test models)."""

    backend = "hf"

    def __init__(self, model, tokenizer=None, name: str | None = None):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", None) or "unnamed"
        self._fingerprint: str | None = None

    # -- facts about the target --------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def fingerprint(self) -> str:
        """A short hash of the weights, the identity a speculator checkpoint records.

        Hashes the embedding's shape and a fixed subset of its rows plus a strided sample of
        every parameter, all cast to bfloat16: an fp32 and a bf16 copy of one target agree,
        while another model, or a fine-tuned copy with the same embedding (Medusa-2's LoRA
        backbone), does not.
        """
        if self._fingerprint is None:
            with torch.no_grad():
                w = self.embed_tokens.weight.detach()
                rows = torch.linspace(0, w.shape[0] - 1, steps=min(256, w.shape[0])).long()
                h = hashlib.sha256(str(tuple(w.shape)).encode())
                h.update(w[rows.to(w.device)].to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
                for name, p in self.model.named_parameters():
                    flat = p.detach().reshape(-1)
                    sample = flat[:: max(1, flat.numel() // 256)][:256].to("cpu", torch.bfloat16).contiguous()
                    h.update(f"{name}{tuple(p.shape)}".encode())
                    h.update(sample.view(torch.int16).numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def identity(self) -> dict:
        """What a speculator checkpoint records about the target it belongs to."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "fingerprint": self.fingerprint(),
        }

    # -- the forward ---------------------------------------------------------------------
    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        """A cache for ``batch`` sequences; ``capacity`` (tokens) is a hint static caches use."""
        return KVCache()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        feature_layers: tuple[int, ...] = (),
        logits_for: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run ``input_ids`` ``[B, n]`` after the committed cache.

        ``tree_mask`` ``[B, n, n]`` bool (True = may attend) among the new tokens; None means
        causal. ``position_ids`` default to ``cache.length + arange(n)``. The new KV entries
        stay pending in ``cache`` until :meth:`KVCache.commit`. ``logits_for`` optionally
        restricts the LM head to those new-token indices (prefill only needs the last one).
        """
        cache.check_ready()
        B, n = input_ids.shape
        dev = self.device
        input_ids = input_ids.to(dev)
        past = cache.length
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=dev)).expand(B, n)
        if tree_mask is None:
            tree_mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(B, n, n)
        full = torch.cat([torch.ones(B, n, past, dtype=torch.bool, device=dev), tree_mask.to(dev)], dim=-1)
        mask = additive_mask(full, self.dtype)
        want_hidden = bool(feature_layers)
        out = self.model.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids.to(dev),
            **hf_cache_kw(cache.hf),
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        cache.mark_appended(n)
        hidden = out.last_hidden_state
        if logits_for is not None:
            hidden = hidden[:, logits_for.to(dev)]
        logits = self.lm_head(hidden)
        feats = None
        if want_hidden:
            hs = out.hidden_states
            feats = torch.stack([hs[i] for i in feature_layers], dim=2)
        return TargetOutput(logits=logits, features=feats)
