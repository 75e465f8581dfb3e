"""TensorRT-LLM checkpoints: Medusa in TRT-LLM's own checkpoint layout, EAGLE-1 in the HF
(SafeAILab) layout its EAGLE converter reads. Writer :func:`export_trtllm`, reader
:func:`load_trtllm`.

Scope and limits. TensorRT-LLM cannot be installed here (its wheel fetches NVIDIA-hosted
libraries), so these layouts follow TRT-LLM's documented conventions but were not loaded by
TRT-LLM itself in this project's tests; the round trip through our own reader is tested.

- Medusa (``"medusa"``): ``config.json`` (TRT-LLM ``PretrainedConfig`` with
  ``architecture: "MedusaForCausalLM"``, the base Llama fields, ``num_medusa_heads``,
  ``num_medusa_layers``, ``max_draft_len``, ``medusa_choices``, ``mapping``) and
  ``rank0.safetensors`` with ``medusa_heads.{i}.medusa_layers.{j}.linear.{weight,bias}`` and
  ``medusa_heads.{i}.lm_head.weight``. With ``include_target=True`` (default) the base model's
  weights are in the same file under TRT-LLM's Llama names (``transformer.vocab_embedding``,
  ``transformer.layers.{l}.attention.qkv`` = cat(q, k, v), ``attention.dense``,
  ``mlp.fc`` = gate_proj, ``mlp.gate`` = up_proj, ``mlp.proj`` = down_proj,
  ``input_layernorm``, ``post_layernorm``, ``transformer.ln_f``, ``lm_head``), making a
  single-rank checkpoint for ``trtllm-build``. Reduced-vocabulary Medusa heads
  (``draft_vocab_size``, a ``d2t`` map) are skipped with that reason: the layout's
  ``lm_head`` covers the whole vocabulary and has no field for a token map.
- EAGLE-1 (``"eagle"``): the SafeAILab layout of :mod:`.sglang` (TRT-LLM's
  ``examples/eagle/convert_checkpoint.py --eagle_model_dir`` reads it beside the base model).
- EAGLE-3: skipped. TRT-LLM's EAGLE-3 draft reads the SafeAILab EAGLE-3 layout, which we could
  not check for the per-feature-layer norms our heads apply before ``fc`` (``fc_norm``); a
  reader that ignored them would serve a different function. Use vLLM or SGLang.
- Draft models: skipped (export ``hf_draft``; TRT-LLM reads HF directories for draft-target).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..identity import ArtifactError, check_artifact
from ._common import (
    artifact_dir,
    check_head_target,
    dtype_name,
    kind_of,
    load_into,
    load_tensors,
    read_json,
    save_tensors,
    skipped,
    write_json,
    written,
)
from .sglang import eagle_layout_problem, load_eagle_layout, write_eagle_layout

__all__ = ["FORMAT", "SUPPORTED_TYPES", "export_trtllm", "load_trtllm", "medusa_choices"]

FORMAT = "trtllm"
SUPPORTED_TYPES = ("medusa", "eagle")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "rank0.safetensors"

_WHY_NOT = {
    "eagle3": "TensorRT-LLM's EAGLE-3 draft reads the SafeAILab layout, whose support for the per-feature-layer "
              "norms before fc (our heads always have them) could not be verified; export 'vllm' or 'sglang'",
    "draft": "a draft LM is an HF model directory; export 'hf_draft'",
}


def _base_config(target, dtype: torch.dtype) -> dict:
    c = target.model.config
    heads = c.num_attention_heads
    rope = getattr(c, "rope_parameters", None) or {}
    cfg = {
        "dtype": dtype_name(dtype),
        "logits_dtype": "float32",
        "vocab_size": int(target.vocab_size),
        "max_position_embeddings": int(c.max_position_embeddings),
        "hidden_size": int(c.hidden_size),
        "num_hidden_layers": int(c.num_hidden_layers),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_size": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        "hidden_act": str(c.hidden_act),
        "intermediate_size": int(c.intermediate_size),
        "norm_epsilon": float(c.rms_norm_eps),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "rotary_scaling": None if rope.get("rope_type", "default") == "default" else dict(rope),
        "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    return cfg


def _base_tensors(target, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The target's weights under TRT-LLM's Llama checkpoint names (tp_size 1)."""
    m = target.model
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    out = {"transformer.vocab_embedding.weight": sd["model.embed_tokens.weight"],
           "transformer.ln_f.weight": sd["model.norm.weight"],
           # a tied lm_head still needs its own tensor in a TRT-LLM checkpoint
           "lm_head.weight": m.get_output_embeddings().weight.detach()}
    for i in range(target.num_layers):
        p, q = f"model.layers.{i}.", f"transformer.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "attention.qkv.weight"] = torch.cat(
            [sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"]], dim=0)
        out[q + "attention.dense.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "post_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        # TRT-LLM's GatedMLP: act(fc(x)) * gate(x), so fc is HF's gate_proj and gate its up_proj
        out[q + "mlp.fc.weight"] = sd[p + "mlp.gate_proj.weight"]
        out[q + "mlp.gate.weight"] = sd[p + "mlp.up_proj.weight"]
        out[q + "mlp.proj.weight"] = sd[p + "mlp.down_proj.weight"]
    return {k: v.to(dtype) for k, v in out.items()}


def _export_medusa(heads, target, out_dir, choices, include_target: bool, dtype) -> dict:
    check_head_target(heads, target)
    out_dtype = dtype or heads.dtype
    K, n = heads.num_heads, heads.architecture["num_layers"]
    choices = heads.tree_choices() if choices is None else [list(map(int, c)) for c in choices]
    too_deep = [c for c in choices if not 1 <= len(c) <= K]
    if too_deep:
        raise ValueError(f"medusa choices must have 1..{K} entries each, got {too_deep[:3]}")
    tensors = {}
    for i, head in enumerate(heads.heads):
        for j in range(n):
            tensors[f"medusa_heads.{i}.medusa_layers.{j}.linear.weight"] = head[j].linear.weight.detach().to(out_dtype)
            tensors[f"medusa_heads.{i}.medusa_layers.{j}.linear.bias"] = head[j].linear.bias.detach().to(out_dtype)
        tensors[f"medusa_heads.{i}.lm_head.weight"] = head[n].weight.detach().to(out_dtype)
    if include_target:
        tensors.update(_base_tensors(target, out_dtype))
    config = {
        "architecture": "MedusaForCausalLM",
        **_base_config(target, out_dtype),
        "num_medusa_heads": int(K),
        "num_medusa_layers": int(n),
        "max_draft_len": len(choices),
        "medusa_choices": choices,
        "specfoundry_includes_base_weights": bool(include_target),
    }
    out = Path(out_dir)
    with artifact_dir(out, target, "medusa", FORMAT) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        count = save_tensors(tensors, tmp / WEIGHTS_NAME)
    notes = [] if include_target else ["heads only: merge with the base model's TRT-LLM checkpoint before trtllm-build"]
    return written(FORMAT, "medusa", out, count, notes)


def export_trtllm(head, target, out_dir, *, medusa_choices=None, include_target: bool = True,
                  dtype: torch.dtype | None = None) -> dict:
    """Write ``head`` as a TensorRT-LLM checkpoint (Medusa) or the HF EAGLE layout TRT-LLM's
    converter reads (EAGLE-1); returns a report entry (``skipped`` with the reason otherwise).

    ``medusa_choices``: the static tree recorded in the config (default: the checkpoint's own,
    :meth:`~specfoundry.runtime.speculators.MedusaHeads.tree_choices`). ``include_target``: also
    write the base model's weights (Medusa).
    """
    kind = kind_of(head)
    if kind == "medusa":
        if head.draft_to_target is not None:  # TRT-LLM's Medusa lm_heads cover the whole vocabulary
            return skipped(FORMAT, kind, f"TensorRT-LLM's Medusa checkpoint has no draft-vocabulary map; these heads cover "
                                         f"{head.draft_vocab_size} of {head.architecture['vocab_size']} tokens "
                                         "(train with speculator.draft_vocab_size unset for this format)")
        return _export_medusa(head, target, out_dir, medusa_choices, include_target, dtype)
    if kind == "eagle":
        why = eagle_layout_problem(head, target, "TensorRT-LLM")
        if why:
            return skipped(FORMAT, kind, why)
        return write_eagle_layout(head, target, out_dir, FORMAT, dtype)
    return skipped(FORMAT, kind, _WHY_NOT.get(kind, f"type {kind!r} has no TensorRT-LLM layout here"))


def medusa_choices(directory) -> list[list[int]]:
    """The static Medusa tree recorded in a TRT-LLM Medusa directory."""
    return [list(c) for c in read_json(Path(directory) / CONFIG_NAME)["medusa_choices"]]


def load_trtllm(directory, target, device=None, dtype=None, check_identity: bool = True):
    """Read a directory written by :func:`export_trtllm` into the runtime's ``MedusaHeads`` or
    ``EagleHead`` for ``target`` (refused for another target unless ``check_identity=False``)."""
    from specfoundry.runtime.speculators import MedusaHeads
    from specfoundry.runtime.speculators.eagle import seeded_init

    directory = Path(directory)
    if check_identity:
        check_artifact(directory, target)
    file = directory / CONFIG_NAME
    cfg = read_json(file)
    if cfg.get("architecture") != "MedusaForCausalLM":
        return load_eagle_layout(directory, target, device, dtype)
    for key in ("num_medusa_heads", "num_medusa_layers", "hidden_size", "vocab_size"):
        if not isinstance(cfg.get(key), int):
            raise ArtifactError(f"{file}: {key} missing or not an int")
    arch = {"hidden_size": cfg["hidden_size"], "vocab_size": cfg["vocab_size"], "num_heads": cfg["num_medusa_heads"],
            "num_layers": cfg["num_medusa_layers"], "feature_layers": [int(target.num_layers)]}
    problems = MedusaHeads.architecture_problems(arch, target)
    if problems:
        raise ArtifactError(f"{file}: does not fit the target: " + "; ".join(f"{k}: {m}" for k, m in problems))
    weights = directory / WEIGHTS_NAME
    raw = load_tensors(weights)
    n = arch["num_layers"]
    ours = {}
    for name, value in raw.items():
        if not name.startswith("medusa_heads."):
            continue  # the base model's weights: the given target is used
        _, i, rest = name.split(".", 2)
        if rest.startswith("medusa_layers."):
            _, j, tail = rest.split(".", 2)
            ours[f"heads.{i}.{j}.{tail}"] = value
        elif rest == "lm_head.weight":
            ours[f"heads.{i}.{n}.weight"] = value
        else:
            raise ArtifactError(f"{weights}: unexpected tensor {name!r}")
    with seeded_init(0):
        heads = MedusaHeads.build(arch, target)
    heads = heads.to(dtype or target.dtype)
    load_into(heads, ours, weights, "Medusa heads")
    return heads.to(device or target.device).eval()
