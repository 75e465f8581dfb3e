#!/usr/bin/env python3
"""Load a speculators-format directory with the ``speculators`` package's own loader and dump
what it built. Runs inside ``.venv-speculators`` (see ``tools/vllm_speculators_env.py``); the
project's tests call it through a subprocess, so nothing here imports specfoundry.

    python tools/vllm_speculators_load.py <speculator dir> <out dir> [<probe.safetensors>]

Writes ``<out>/state.safetensors`` (the loaded model's state dict), ``<out>/summary.json``
(class, config fields, vocabulary use) and, given a probe file holding ``features``
``[1, n, F, H]`` (feature layers in ascending order) and ``input_ids`` ``[1, n]``,
``<out>/logits.safetensors``: one EAGLE-3 step through speculators' own modules (fc_norm ->
fc, its first decoder layer with causal attention, norm, lm_head), scattered to target ids
through its ``d2t`` offsets, in float64.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main(src: str, out: str, probe: str | None = None) -> int:
    from speculators.model import SpeculatorModel

    model = SpeculatorModel.from_pretrained(src)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "state.safetensors"))
    cfg = model.config
    summary = {
        "class": type(model).__name__,
        "speculators_model_type": cfg.speculators_model_type,
        "draft_vocab_size": cfg.draft_vocab_size,
        "use_draft_vocab": bool(getattr(model, "use_draft_vocab", False)),
        "eagle_aux_hidden_state_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids or []),
        "fc_norm": bool(cfg.fc_norm),
        "norm_before_residual": bool(cfg.norm_before_residual),
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "num_speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "embed_has_nan": bool(model.embed_tokens.weight.isnan().any()),
    }
    if probe:
        model = model.to(torch.float64).eval()
        tl = cfg.transformer_layer_config
        tl._attn_implementation = "sdpa"  # speculators defaults to flex attention (training)
        p = load_file(probe)
        feats, ids = p["features"].to(torch.float64), p["input_ids"].long()
        n = ids.shape[1]
        chunks = [feats[:, :, j] for j in range(feats.shape[2])]
        if model.fc_norm is not None:
            chunks = [norm(c) for norm, c in zip(model.fc_norm, chunks)]
        hidden = model.fc(torch.cat(chunks, dim=-1))
        embeds = model.embed_tokens(ids)
        pos = torch.arange(n).unsqueeze(0)
        x = torch.cat([embeds, hidden], dim=-1)
        pos_emb = model.rotary_emb(x, pos)
        with torch.no_grad():
            h = model.layers[0](x, attention_mask=None, position_ids=pos, position_embeddings=pos_emb)
            logits = model.lm_head(model.norm(h))
        V = tl.vocab_size
        full = torch.full((*logits.shape[:-1], V), float("-inf"), dtype=logits.dtype)
        if model.d2t is not None:
            targets = torch.arange(logits.shape[-1]) + model.d2t
        else:
            targets = torch.arange(V)
        full[..., targets] = logits
        save_file({"logits": full.contiguous(), "hidden": h.contiguous()}, str(out_dir / "logits.safetensors"))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
