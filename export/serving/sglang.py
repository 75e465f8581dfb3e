"""The SafeAILab EAGLE / EAGLE-3 checkpoint layout that SGLang reads: writer
:func:`export_sglang`, reader :func:`load_sglang`.

Scope: EAGLE-1 (``"eagle"``) and EAGLE-3 (``"eagle3"``) heads, served by SGLang with
``--speculative-algorithm EAGLE`` / ``EAGLE3 --speculative-draft-model-path <dir>``. The same
EAGLE-1 directory is what vLLM's ``method="eagle"`` and TensorRT-LLM's EAGLE converter read
(:mod:`.trtllm` reuses :func:`write_eagle_layout`). Medusa and draft models: ``skipped``.

Directory: ``config.json`` (an HF ``LlamaConfig`` with ``num_hidden_layers: 1``),
``model.safetensors`` (safetensors, not ``pytorch_model.bin``: SGLang reads both) and our
``specfoundry_target.json``. Tensor names:

- EAGLE-1 (``architectures: ["LlamaForCausalLMEagle"]``): ``fc.weight``, ``fc.bias`` (2H -> H,
  ``cat(embed, feature)``), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``.
  No ``input_layernorm`` (SafeAILab's first layer skips it; SGLang deletes it) and no
  embedding / LM head: SGLang hands the draft the target's.
- EAGLE-3 (``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``): ``fc.weight``
  (F*H -> H, no bias), ``fc_norm.{j}.weight`` (config ``fc_norm: true``: SGLang >= 0.5.23
  applies an RMSNorm to each feature layer before ``fc``, which our heads always do),
  ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.*`` (q/k/v read 2H), ``midlayer.mlp.*``, ``norm.weight``,
  ``lm_head.weight`` (draft vocabulary, sorted by target id), ``d2t`` (int64 offsets:
  ``target = draft + d2t``, SGLang's ``hot_token_id``) and ``t2d`` (bool over the target vocab).

Feature layers (EAGLE-3). SGLang collects them in ascending layer order, so ``fc`` column blocks
are permuted into that order. For the EAGLE-3 default (inputs of layers ``2, L//2, L-3``) the
config names no layers, and every reader (SafeAILab, SGLang, vLLM) uses that default. Other
choices go in ``eagle_config.eagle_aux_hidden_state_layer_ids`` with SGLang's meaning: id ``k``
is the *output* of layer ``k`` (SGLang captures before layer ``k + 1``), i.e. our index minus 1.
vLLM reads that key with our meaning, so a non-default directory is SGLang-specific (the vLLM
``speculators`` format of :mod:`.vllm` is the one to give vLLM).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..identity import ArtifactError, check_artifact
from ._common import (
    arch_from_llama_config,
    artifact_dir,
    check_head_target,
    default_eagle3_layers,
    dtype_name,
    eagle3_fused_tensors,
    feature_order,
    kind_of,
    layer_tensors,
    llama_layer_config,
    load_into,
    load_tensors,
    read_json,
    save_tensors,
    skipped,
    sorted_draft_vocab,
    write_json,
    written,
)
from .vllm import d2t_from_offsets, d2t_to_offsets

__all__ = ["FORMAT", "SUPPORTED_TYPES", "eagle_layout_problem", "export_sglang", "load_eagle_layout", "load_sglang",
           "write_eagle_layout"]

FORMAT = "sglang"
SUPPORTED_TYPES = ("eagle", "eagle3")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ARCH_EAGLE = "LlamaForCausalLMEagle"
ARCH_EAGLE3 = "LlamaForCausalLMEagle3"

_WHY_NOT = {
    "medusa": "SGLang has no Medusa support; export 'trtllm' for Medusa",
    "draft": "a draft LM is an HF model directory; export 'hf_draft' (SGLang's STANDALONE algorithm reads it)",
}


def eagle_layout_problem(head, target, fmt: str) -> str | None:
    """Why ``head`` cannot be written in the SafeAILab layout (None when it can)."""
    kind = kind_of(head)
    if kind not in SUPPORTED_TYPES:
        return _WHY_NOT.get(kind, f"type {kind!r} has no SafeAILab EAGLE layout")
    if kind == "eagle3":
        L = target.num_layers
        order, why = feature_order(head.feature_layers, L, 1, fmt)
        if order is None:
            return why
    return None


def _eagle3_layer_config(head, target) -> tuple[dict, list[int]]:
    L = target.num_layers
    layers = sorted(int(i) for i in head.feature_layers)
    cfg = {}
    if layers != default_eagle3_layers(L):
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers], "use_aux_hidden_state": True}
    return cfg, layers


def write_eagle_layout(head, target, out_dir, fmt: str, dtype: torch.dtype | None = None, extra_config: dict | None = None) -> dict:
    """Write the SafeAILab layout for an EAGLE-1/EAGLE-3 head (the caller checked
    :func:`eagle_layout_problem`). Returns a report entry for ``fmt``."""
    kind = kind_of(head)
    check_head_target(head, target)
    out_dtype = dtype or head.dtype
    arch = head.architecture
    config = {"architectures": [ARCH_EAGLE if kind == "eagle" else ARCH_EAGLE3], **llama_layer_config(arch),
              "dtype": dtype_name(out_dtype), "torch_dtype": dtype_name(out_dtype)}
    notes = []
    if kind == "eagle":
        tensors = {
            "fc.weight": head.fc.weight.detach().to(out_dtype),
            "fc.bias": head.fc.bias.detach().to(out_dtype),
            **layer_tensors(head, "layers.0.", out_dtype),
        }
    else:
        order, _ = feature_order(head.feature_layers, target.num_layers, 1, fmt)
        layer_cfg, layers = _eagle3_layer_config(head, target)
        config.update(layer_cfg)
        config.update({"draft_vocab_size": int(arch["draft_vocab_size"]), "target_hidden_size": int(arch["hidden_size"]),
                       "fc_norm": True, "norm_before_residual": False})
        d2t, lm_head = sorted_draft_vocab(head, out_dtype)
        t2d = torch.zeros(int(arch["vocab_size"]), dtype=torch.bool)
        t2d[d2t] = True
        tensors = {
            **eagle3_fused_tensors(head, order, out_dtype),
            **layer_tensors(head, "midlayer.", out_dtype),
            "norm.weight": head.norm.weight.detach().to(out_dtype),
            "lm_head.weight": lm_head,
            "d2t": d2t_to_offsets(d2t),
            "t2d": t2d,
        }
        if layers != list(head.feature_layers):
            notes.append(f"feature layers {list(head.feature_layers)} written in ascending order {layers}")
        if "eagle_config" not in config:
            notes.append("default EAGLE-3 feature layers: the config names none (every reader's default)")
    if extra_config:
        config.update(extra_config)
    out = Path(out_dir)
    with artifact_dir(out, target, kind, fmt) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        n = save_tensors(tensors, tmp / WEIGHTS_NAME)
    return written(fmt, kind, out, n, notes)


def export_sglang(head, target, out_dir, *, dtype: torch.dtype | None = None) -> dict:
    """Write ``head`` (EAGLE-1 or EAGLE-3) in the SafeAILab layout SGLang reads; returns a
    report entry (``skipped`` with the reason for other types or unrepresentable heads)."""
    why = eagle_layout_problem(head, target, "SGLang")
    if why:
        return skipped(FORMAT, kind_of(head), why)
    return write_eagle_layout(head, target, out_dir, FORMAT, dtype)


def load_eagle_layout(directory, target, device=None, dtype=None):
    """Read a SafeAILab-layout EAGLE-1/EAGLE-3 directory into the runtime's head (no identity check)."""
    from specfoundry.runtime.speculators import Eagle3Head, EagleHead
    from specfoundry.runtime.speculators.eagle import seeded_init

    directory = Path(directory)
    file = directory / CONFIG_NAME
    cfg = read_json(file)
    archs = cfg.get("architectures") or []
    weights = directory / WEIGHTS_NAME
    raw = load_tensors(weights)
    raw.pop("embed_tokens.weight", None)  # the target's own embedding is used
    L = target.num_layers
    is_eagle3 = ARCH_EAGLE3 in archs or "draft_vocab_size" in cfg or any(k.startswith("midlayer.") for k in raw)
    if not is_eagle3:
        cls = EagleHead
        arch = arch_from_llama_config(cfg, file, [L])
        ours = {("layer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in raw.items()}
    else:
        cls = Eagle3Head
        for key in ("norm_before_fc", "norm_output"):
            if cfg.get(key):
                raise ArtifactError(f"{file}: {key}=true is a variant the runtime's Eagle3Head does not implement")
        if cfg.get("norm_before_residual"):
            raise ArtifactError(f"{file}: norm_before_residual=true is not implemented by the runtime's Eagle3Head")
        if not (cfg.get("fc_norm") or cfg.get("use_aux_norm")):
            raise ArtifactError(f"{file}: no fc_norm; the runtime's Eagle3Head always normalises each feature layer")
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        # SGLang's ids name a layer's output (our index - 1); absent means the EAGLE-3 default
        layers = [int(i) + 1 for i in ids] if ids else default_eagle3_layers(L)
        arch = arch_from_llama_config(cfg, file, layers)
        V = arch["vocab_size"]
        arch["draft_vocab_size"] = int(cfg.get("draft_vocab_size") or V)
        Vd = arch["draft_vocab_size"]
        if "d2t" not in raw:
            raise ArtifactError(f"{weights}: missing tensor 'd2t'")
        d2t = d2t_from_offsets(raw.pop("d2t"))
        raw.pop("t2d", None)
        if d2t.numel() != Vd or int(d2t.min()) < 0 or int(d2t.max()) >= V or d2t.unique().numel() != Vd:
            raise ArtifactError(f"{weights}: d2t does not map {Vd} distinct draft ids into [0, {V})")
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[d2t] = True
        legacy = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
        ours = {"d2t": d2t, "t2d": t2d}
        for name, value in raw.items():
            for old, new in legacy.items():
                name = name.replace(old, new)
            if name.startswith("midlayer."):
                name = "layer." + name[len("midlayer."):]
            elif name.startswith("fc_norm."):
                name = "feature_norms." + name[len("fc_norm."):]
            ours[name] = value
    problems = cls.architecture_problems(arch, target)
    if problems:
        raise ArtifactError(f"{file}: does not fit the target: " + "; ".join(f"{k}: {m}" for k, m in problems))
    with seeded_init(0):  # overwritten below; keep the caller's RNG untouched
        head = cls.build(arch, target)
    head = head.to(dtype or target.dtype)
    load_into(head, ours, weights, f"an {cls.type} head")
    return head.to(device or target.device).eval()


def load_sglang(directory, target, device=None, dtype=None, check_identity: bool = True):
    """Read an SGLang/SafeAILab EAGLE directory into the runtime's head for ``target`` (refused
    when its ``specfoundry_target.json`` names another target, unless ``check_identity=False``)."""
    if check_identity:
        check_artifact(directory, target)
    return load_eagle_layout(directory, target, device, dtype)
