"""The decoder layer both EAGLE heads are built on, and its part of their architecture.

Scope: :data:`LLAMA_LAYER_SCHEMA` (the Llama decoder-layer keys of an EAGLE ``architecture``
dict), :func:`layer_arch_from_target` (those keys copied from a target),
:func:`layer_architecture_problems` (their semantic checks), :func:`layer_config` (the
``LlamaConfig`` of the head's one layer) and the two upstream-layer subclasses
:class:`Eagle1DecoderLayer` / :class:`Eagle3DecoderLayer`. The heads themselves (and why they
differ) are in :mod:`.eagle`, which re-exports the layer classes.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

__all__ = ["LLAMA_LAYER_SCHEMA", "Eagle1DecoderLayer", "Eagle3DecoderLayer", "layer_arch_from_target",
           "layer_architecture_problems", "layer_config"]

# Architecture schema format (validated by checkpoint.py): key -> int | float | str | bool | dict
# | ("list", int). Every key is required; unknown keys are errors.
LLAMA_LAYER_SCHEMA = {
    "vocab_size": int,  # the target vocabulary (embedding rows)
    "hidden_size": int,
    "intermediate_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "head_dim": int,
    "hidden_act": str,
    "rms_norm_eps": float,
    "rope_parameters": dict,
    "max_position_embeddings": int,
    "feature_layers": ("list", int),
}


def layer_arch_from_target(target) -> dict:
    """Decoder-layer shape copied from the target, so a head layer can be initialised from a
    target layer and shares its RoPE."""
    c = target.config
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": float(getattr(c, "rope_theta", 10000.0))}
    return {
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.hidden_size),
        "intermediate_size": int(c.intermediate_size),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(c, "head_dim", None) or target.hidden_size // heads),
        "hidden_act": str(c.hidden_act),
        "rms_norm_eps": float(c.rms_norm_eps),
        "rope_parameters": copy.deepcopy(dict(rope)),
        "max_position_embeddings": int(c.max_position_embeddings),
    }


def layer_config(arch: dict) -> LlamaConfig:
    """The ``LlamaConfig`` of a head's one decoder layer."""
    cfg = LlamaConfig(
        vocab_size=arch["vocab_size"],
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"],
        num_hidden_layers=1,
        num_attention_heads=arch["num_attention_heads"],
        num_key_value_heads=arch["num_key_value_heads"],
        head_dim=arch["head_dim"],
        hidden_act=arch["hidden_act"],
        rms_norm_eps=arch["rms_norm_eps"],
        rope_parameters=copy.deepcopy(arch["rope_parameters"]),
        max_position_embeddings=arch["max_position_embeddings"],
    )
    # sdpa takes the additive float tree mask as-is, like the eager path, and is faster
    cfg._attn_implementation = "sdpa"
    return cfg


def layer_architecture_problems(arch: dict) -> list[tuple[str, str]]:
    """Semantic checks of the decoder-layer keys: ``[(key, problem), ...]`` (empty when fine)."""
    out = []
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings"):
        if arch[k] < 1:
            out.append((k, f"must be >= 1, got {arch[k]}"))
    if not out and arch["num_attention_heads"] % arch["num_key_value_heads"]:
        out.append(("num_key_value_heads", f"{arch['num_key_value_heads']} does not divide num_attention_heads {arch['num_attention_heads']}"))
    if not (math.isfinite(arch["rms_norm_eps"]) and 0 < arch["rms_norm_eps"] < 1):
        out.append(("rms_norm_eps", f"must be a finite number in (0, 1), got {arch['rms_norm_eps']}"))
    from transformers.activations import ACT2FN
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if arch["hidden_act"] not in ACT2FN:
        out.append(("hidden_act", f"unknown activation {arch['hidden_act']!r:.40}"))
    rope = arch["rope_parameters"]
    if "rope_type" not in rope or "rope_theta" not in rope:
        out.append(("rope_parameters", "must hold at least 'rope_type' and 'rope_theta'"))
    else:
        if rope["rope_type"] != "default" and rope["rope_type"] not in ROPE_INIT_FUNCTIONS:
            out.append(("rope_parameters.rope_type", f"unknown rope type {rope['rope_type']!r:.40}"))
        theta = rope["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            out.append(("rope_parameters.rope_theta", f"must be a finite number > 0, got {theta!r:.40}"))
    return out


class Eagle1DecoderLayer(LlamaDecoderLayer):
    """Upstream ``LlamaDecoderLayer``; changed: ``input_layernorm`` is the identity (EAGLE-1's
    first layer feeds the fc output to attention un-normalised)."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, layer_idx=0)
        self.input_layernorm = nn.Identity()


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """Upstream ``LlamaDecoderLayer``; changed (as in EAGLE-3):

    - ``q_proj``/``k_proj``/``v_proj`` read ``2H`` inputs: ``cat(input_layernorm(embed),
      hidden_norm(h))``;
    - a new ``hidden_norm`` for the hidden stream; ``input_layernorm`` normalises the embedding;
    - the attention residual is the hidden stream ``h`` (not the concatenation).
    """

    def __init__(self, config: LlamaConfig):
        super().__init__(config, layer_idx=0)
        H, hd = config.hidden_size, config.head_dim
        bias = config.attention_bias
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * H, config.num_attention_heads * hd, bias=bias)
        attn.k_proj = nn.Linear(2 * H, config.num_key_value_heads * hd, bias=bias)
        attn.v_proj = nn.Linear(2 * H, config.num_key_value_heads * hd, bias=bias)
        self.hidden_norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)

    def forward(self, hidden_states, input_embeds=None, attention_mask=None, position_ids=None,
                use_cache=False, position_embeddings=None, **kwargs):
        # the KV cache comes in ``kwargs`` under the installed transformers' name (target.hf_cache_kw)
        residual = hidden_states
        x = torch.cat([self.input_layernorm(input_embeds), self.hidden_norm(hidden_states)], dim=-1)
        attn_out, _ = self.self_attn(
            hidden_states=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + attn_out
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states
