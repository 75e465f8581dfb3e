"""vLLM's ``speculators`` checkpoint format (EAGLE-3): writer :func:`export_vllm` and reader
:func:`load_vllm`.

Scope: EAGLE-3 heads in the ``speculators`` format, and Medusa heads in vLLM's own Medusa layout
(written and read by :mod:`.vllm_medusa`, method ``"medusa"``; it carries a reduced vocabulary's
token map). The format (``speculators`` 0.9.0, read by vLLM >= 0.10 through
``speculative_config={"method": "eagle3", "model": <dir>}``) has no EAGLE-1 or Medusa model
type: EAGLE-1 goes through the SafeAILab layout (:mod:`.sglang`, vLLM method ``"eagle"``),
draft models through :mod:`.hf_draft`. Other types get a ``skipped`` report entry.

Directory::

    config.json               speculators Eagle3SpeculatorConfig (below)
    model.safetensors         fc.weight, fc_norm.{j}.weight, layers.0.*, norm.weight, lm_head.weight,
                              embed_tokens.weight, d2t (int64 OFFSETS), t2d (bool)   -- d2t/t2d only when the draft
                              vocabulary is smaller than the target's
    specfoundry_target.json   the target this head belongs to (ours; engines ignore it)

Facts the mapping relies on (read from speculators 0.9.0 ``models/eagle3`` and vLLM 0.32
``model_executor/models/llama_eagle3.py``):

- ``d2t`` is an offset table: ``target_id = draft_id + d2t[draft_id]`` (vLLM
  ``compute_logits``; speculators ``build_vocab_mappings_from_distribution``). Our runtime's
  ``Eagle3Head.d2t`` holds absolute target ids, so the writer stores ``d2t - arange`` and the
  reader adds it back. The draft vocabulary is written sorted by target id (as the speculators
  trainer makes it; ``t2d`` masking of a verifier ``lm_head`` assumes that order).
- ``eagle_aux_hidden_state_layer_ids`` are collected in ascending order, id ``k`` being the
  residual stream entering layer ``k`` (HF ``hidden_states[k]``; id 0 = embeddings). Our
  ``feature_layers`` use the same numbering but any order, so ``fc`` column blocks (and the
  per-layer norms) are permuted into ascending order. Index ``L`` means the final *normed*
  state to us but the un-normed last-layer output to vLLM: such heads are skipped.
- Our per-feature-layer RMSNorms before ``fc`` are the format's ``fc_norm: true``
  (``fc_norm.{j}.weight``); ``norm_before_residual`` must be written ``false`` explicitly
  (vLLM defaults it to ``true`` when absent), matching our layer (residual = raw hidden).
- The token embedding (the target's, which our head uses by reference) is stored as
  ``embed_tokens.weight``, as speculators' own ``save_pretrained`` does. vLLM compares it with
  the target's and shares the target's when equal. Without it, speculators 0.9.0's loader
  (under transformers 5.19) leaves the embedding uninitialised memory instead of copying the
  verifier's (seen here: its NaN sentinel does not survive ``from_pretrained``), so
  ``include_embedding=False`` is for vLLM-only deployments that want the smaller file.
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

__all__ = ["FORMAT", "SPECULATORS_VERSION", "SUPPORTED_TYPES", "d2t_from_offsets", "d2t_to_offsets", "export_vllm",
           "load_vllm"]

FORMAT = "vllm"
SUPPORTED_TYPES = ("eagle3",)
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

_WHY_NOT = {
    "eagle": "the speculators format (0.9.0) has no EAGLE-1 model type; export the 'sglang' layout, which vLLM "
             "serves with method 'eagle'",
    "draft": "a draft LM is served by vLLM as a plain HF directory (method 'draft_model'); export 'hf_draft'",
}


def d2t_to_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Absolute draft->target ids (our runtime) -> the offset table vLLM/speculators store."""
    d2t = d2t.to(torch.long)
    return d2t - torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device)


def d2t_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """vLLM/speculators offsets -> absolute target ids."""
    offsets = offsets.to(torch.long)
    return offsets + torch.arange(offsets.numel(), dtype=torch.long, device=offsets.device)


def _verifier_path(target, verifier) -> str | None:
    if verifier is not None:
        return str(verifier)
    path = getattr(target.model.config, "_name_or_path", None) or None
    return str(path) if path else None


def export_vllm(head, target, out_dir, *, num_speculative_tokens: int = 3, verifier=None,
                dtype: torch.dtype | None = None, include_embedding: bool = True) -> dict:
    """Write ``head`` (an ``Eagle3Head`` for ``target``) as a speculators-format directory.

    ``num_speculative_tokens``: the proposal length recorded in the config (vLLM's default ``k``
    when the serving command gives none). ``verifier``: the target's path or hub id recorded as
    ``speculators_config.verifier.name_or_path`` (default: the target's ``_name_or_path``).
    ``dtype``: cast floating tensors (default: the head's dtype). ``include_embedding``: store
    the target's token embedding (see the module notes). Returns a report entry.
    """
    kind = kind_of(head)
    if kind == "medusa":  # vLLM's own Medusa layout (with its token map for a reduced vocabulary)
        from .vllm_medusa import export_vllm_medusa

        return export_vllm_medusa(head, target, out_dir, dtype=dtype)
    if kind != "eagle3":
        return skipped(FORMAT, kind, _WHY_NOT.get(kind, f"type {kind!r} has no speculators-format model type"))
    check_head_target(head, target)
    L = target.num_layers
    order, why = feature_order(head.feature_layers, L, 0, "vLLM")
    if order is None:
        return skipped(FORMAT, kind, why)
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    layers = sorted(int(i) for i in head.feature_layers)
    arch = head.architecture
    V, Vd = int(arch["vocab_size"]), int(arch["draft_vocab_size"])
    out_dtype = dtype or head.dtype

    d2t, lm_head = sorted_draft_vocab(head, out_dtype)
    tensors = {
        **eagle3_fused_tensors(head, order, out_dtype),
        **layer_tensors(head, "layers.0.", out_dtype),
        "norm.weight": head.norm.weight.detach().to(out_dtype),
        "lm_head.weight": lm_head,
    }
    if include_embedding:
        tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to("cpu", out_dtype)
    if Vd != V:
        # a full-size draft vocabulary has no mapping in this format (vLLM then has no
        # draft_id_to_target_id parameter to load it into); sorted, its lm_head is in target order
        tensors["d2t"] = d2t_to_offsets(d2t)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[d2t] = True
        tensors["t2d"] = t2d

    layer_cfg = llama_layer_config(arch)
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_cfg,
        "draft_vocab_size": Vd,
        "target_hidden_size": None,  # the draft's hidden size is the target's
        "eagle_aux_hidden_state_layer_ids": layers,
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype_name(out_dtype),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{
                "proposal_type": "greedy",
                "speculative_tokens": int(num_speculative_tokens),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": _verifier_path(target, verifier),
                "architectures": list(getattr(target.model.config, "architectures", None) or ["LlamaForCausalLM"]),
            },
        },
    }
    out = Path(out_dir)
    with artifact_dir(out, target, kind, FORMAT) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        n = save_tensors(tensors, tmp / WEIGHTS_NAME)
    notes = [f"feature layers {list(head.feature_layers)} written in ascending order {layers}"] \
        if layers != list(head.feature_layers) else []
    if Vd == V:
        notes.append("full-size draft vocabulary: no d2t/t2d (lm_head rows in target-id order)")
    return written(FORMAT, kind, out, n, notes)


def load_vllm(directory, target, device=None, dtype=None, check_identity: bool = True):
    """Read a speculators-format EAGLE-3 directory into the runtime's ``Eagle3Head`` for ``target``.

    With ``check_identity`` (default) the directory's ``specfoundry_target.json`` must name
    ``target`` (:class:`~specfoundry.export.identity.ArtifactMismatchError` otherwise); without
    it (a checkpoint from elsewhere) only the shapes are checked against the target.
    """
    from specfoundry.runtime.speculators import Eagle3Head
    from specfoundry.runtime.speculators.eagle import seeded_init

    directory = Path(directory)
    if check_identity:
        check_artifact(directory, target)
    file = directory / CONFIG_NAME
    cfg = read_json(file)
    if cfg.get("model_type") == "medusa" and "speculators_model_type" not in cfg:
        from .vllm_medusa import load_vllm_medusa

        return load_vllm_medusa(directory, target, device, dtype, check_identity=False)  # identity checked above
    if cfg.get("speculators_model_type") != "eagle3":
        raise ArtifactError(f"{file}: speculators_model_type {cfg.get('speculators_model_type')!r} is not 'eagle3'")
    unsupported = {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}
    for key, bad in unsupported.items():
        # vLLM's default for a missing norm_before_residual is true
        value = cfg.get(key, key == "norm_before_residual")
        if bool(value) == bad:
            raise ArtifactError(f"{file}: {key}={value} is a variant the runtime's Eagle3Head does not implement")
    if not cfg.get("fc_norm", False):
        raise ArtifactError(f"{file}: fc_norm is false; the runtime's Eagle3Head always normalises each feature layer")
    if cfg.get("target_hidden_size") not in (None, (cfg.get("transformer_layer_config") or {}).get("hidden_size")):
        raise ArtifactError(f"{file}: target_hidden_size {cfg['target_hidden_size']} differs from the draft's hidden size")
    layer_cfg = cfg.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ArtifactError(f"{file}: transformer_layer_config missing")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or default_eagle3_layers(target.num_layers)
    arch = arch_from_llama_config(layer_cfg, file, layers)
    arch["draft_vocab_size"] = int(cfg.get("draft_vocab_size") or arch["vocab_size"])
    problems = Eagle3Head.architecture_problems(arch, target)
    if problems:
        raise ArtifactError(f"{file}: does not fit the target: " + "; ".join(f"{k}: {m}" for k, m in problems))

    weights = directory / WEIGHTS_NAME
    raw = load_tensors(weights)
    embed = raw.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != tuple(target.embed_tokens.weight.shape):
        raise ArtifactError(f"{weights}: embed_tokens.weight {tuple(embed.shape)} does not fit the target's embedding")
    # the head uses the target's own embedding by reference (the stored copy is for engines)
    V, Vd = arch["vocab_size"], arch["draft_vocab_size"]
    if "d2t" in raw:
        d2t = d2t_from_offsets(raw.pop("d2t"))
        raw.pop("t2d", None)
    else:
        if Vd != V:
            raise ArtifactError(f"{weights}: draft_vocab_size {Vd} < vocab_size {V} but no d2t tensor")
        d2t = torch.arange(Vd, dtype=torch.long)
    if d2t.numel() != Vd or int(d2t.min()) < 0 or int(d2t.max()) >= V or d2t.unique().numel() != Vd:
        raise ArtifactError(f"{weights}: d2t does not map {Vd} distinct draft ids into [0, {V})")
    ours = {"d2t": d2t}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[d2t] = True
    ours["t2d"] = t2d
    for name, value in raw.items():
        if name.startswith("layers.0."):
            ours["layer." + name[len("layers.0."):]] = value
        elif name.startswith("fc_norm."):
            ours["feature_norms." + name[len("fc_norm."):]] = value
        else:
            ours[name] = value
    with seeded_init(0):  # overwritten below; keep the caller's RNG untouched
        head = Eagle3Head.build(arch, target)
    head = head.to(dtype or target.dtype)
    load_into(head, ours, weights, "an EAGLE-3 head")
    return head.to(device or target.device).eval()
