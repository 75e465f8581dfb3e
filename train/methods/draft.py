"""Draft-model distillation: a small causal LM sharing the tokenizer learns the target's
next-token distributions (forward KL, or total variation, which is exactly one minus the
expected acceptance rate of speculative sampling) on the assistant tokens."""

from __future__ import annotations

import torch

from .common import finish_metrics, forward_kl, total_variation


class DraftKDMethod(torch.nn.Module):
    def __init__(self, draft_model, target_lm_head: torch.nn.Linear, kd_loss: str = "forward_kl",
                 temperature: float = 1.0):
        super().__init__()
        if kd_loss not in ("forward_kl", "tv"):
            raise ValueError(f"kd_loss must be 'forward_kl' or 'tv', got {kd_loss!r}")
        self.draft = draft_model  # an HF causal LM (trainable)
        self.kd_loss = kd_loss
        self.temperature = temperature
        self._lm = {"head": target_lm_head}

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        # position t's logits predict token t+1: train where that token is an assistant token
        mask = (attn.bool() & batch["loss_mask"].bool())[:, 1:]
        q = self.draft(input_ids=ids, attention_mask=attn).logits[:, :-1] / self.temperature
        lm = self._lm["head"]
        with torch.no_grad():
            p = lm(batch["last_hidden"][:, :-1].to(lm.weight.dtype)).float() / self.temperature
        loss = forward_kl(q, p, mask) if self.kd_loss == "forward_kl" else total_variation(q, p, mask)
        with torch.no_grad():
            agree = ((q.argmax(-1) == p.argmax(-1)) & mask).sum() / mask.sum().clamp(min=1)
            accept = 1.0 - float(total_variation(q, p, mask))
        return loss, finish_metrics({"top1/step0": float(agree), "acceptance_estimate": accept}, [float(agree)], loss)


def draft_model_for(spec, target):
    """The draft a recipe's ``speculator`` section describes, as a TargetModel in float32:
    ``layers`` (a subset of the target's layers), ``config`` (a fresh Llama of that shape with the
    target's vocabulary; embedding and LM head copied from the target when the widths match) or
    ``init_from`` (a pretrained model that must share the target's tokenizer)."""
    import copy

    from specfoundry.runtime import TargetModel
    from specfoundry.runtime.drafters.draft import layer_subset_model

    if spec.layers is not None:
        lm = layer_subset_model(target, list(spec.layers))
    elif spec.config is not None:
        from transformers import LlamaConfig, LlamaForCausalLM

        c, tc = spec.config, target.model.config
        heads = c.num_attention_heads
        cfg = LlamaConfig(vocab_size=target.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                          num_attention_heads=heads, num_key_value_heads=c.num_key_value_heads or heads,
                          intermediate_size=c.intermediate_size or -(-(8 * c.hidden_size // 3) // 64) * 64,
                          head_dim=c.head_dim or c.hidden_size // heads,
                          max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                          rope_parameters=copy.deepcopy(getattr(tc, "rope_parameters", None)),
                          tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
                          bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
        model = LlamaForCausalLM(cfg)
        if c.hidden_size == target.hidden_size:  # the target's token geometry is a better start than noise
            with torch.no_grad():
                model.model.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
                model.lm_head.weight.copy_(target.lm_head.weight.float())
        lm = TargetModel(model, target.tokenizer, name=f"{target.name}-draft-{c.num_layers}x{c.hidden_size}")
    elif spec.init_from is not None:
        lm = _pretrained_draft(spec.init_from, target)
    else:
        raise ValueError("a draft recipe needs exactly one of speculator.layers / config / init_from")
    lm.model.float().train()
    for p in lm.model.parameters():
        p.requires_grad_(True)
    return lm


def _pretrained_draft(name: str, target):
    """``init_from``: a built-in target name or a local HF directory (hub ids are tried through
    transformers, which needs the hub or its cache); refused unless it shares the tokenizer."""
    from pathlib import Path

    from specfoundry.runtime import TargetModel, load_target

    from transformers.integrations import deepspeed as hf_ds

    try:
        # a whole HF model (the HF path, no engine): under ZeRO-3 transformers would otherwise build
        # it already partitioned, empty in every process (DeepSpeed partitions it at prepare)
        ref = hf_ds._hf_deepspeed_config_weak_ref
        hf_ds.unset_hf_deepspeed_config()
        try:
            lm = load_target(name, dtype=torch.float32, backend="hf")
        finally:
            hf_ds._hf_deepspeed_config_weak_ref = ref
    except FileNotFoundError:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(name)
        except OSError as e:
            raise ValueError(f"speculator.init_from {name!r}: not a built-in target, not a local model directory "
                             f"and not loadable from the hub or its cache ({e.__class__.__name__})") from None
        lm = TargetModel(model, tok, name=Path(name).name)
    if lm.vocab_size != target.vocab_size:
        raise ValueError(f"speculator.init_from {name!r} has a {lm.vocab_size}-token vocabulary, the target "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    if lm.tokenizer is not None and target.tokenizer is not None and lm.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"speculator.init_from {name!r} uses a different tokenizer from the target's "
                         "(same size, different tokens): its drafts would be other tokens")
    return lm
