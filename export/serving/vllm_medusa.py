"""vLLM's own Medusa checkpoint (``speculative_config={"method": "medusa", "model": <dir>}``):
writer :func:`export_vllm_medusa` and reader :func:`load_vllm_medusa`; :mod:`.vllm` routes
``"medusa"`` heads here (the ``speculators`` format it writes for EAGLE-3 has no Medusa type).

Scope: full-vocabulary and reduced-vocabulary Medusa heads. This is the one serving layout with
a Medusa vocabulary map, so reduced heads (``draft_vocab_size``, ``d2t``) are exported with it;
TensorRT-LLM's (:mod:`.trtllm`) has none and skips them.

Directory::

    config.json               MedusaConfig: model_type "medusa", architectures ["MedusaModel"],
                              hidden_size, vocab_size, num_heads, num_hidden_layers (residual blocks
                              per head), truncated_vocab_size, medusa_fc_bias: true
    model.safetensors         blocks.{i}.layers.{j}.{weight,bias}, lm_heads.{i}.weight
                              ([truncated_vocab_size, H]), token_map (int64 absolute target ids,
                              only when truncated_vocab_size < vocab_size)
    specfoundry_target.json   the target these heads belong to (ours; engines ignore it)

Facts the mapping relies on (read from vLLM 0.32 ``model_executor/models/medusa.py`` and
``transformers_utils/configs/medusa.py``, installed in ``.venv-vllm``; not served end to end here):
a block is ``x + SiLU(Linear(x))`` per layer (ours: :class:`ResBlock`), with a bias only when
``medusa_fc_bias`` is true; the heads read the target's final normed hidden state (vLLM's model
output, our feature index ``L``); with ``truncated_vocab_size < vocab_size`` and a ``token_map``
tensor, head logits are written into a ``-inf`` full-vocabulary row at ``token_map``, i.e.
``token_map`` is our ``d2t``. vLLM drafts top-1 chains from the heads (no static tree), so the
runtime's ``choices`` are not part of this layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..identity import ArtifactError, check_artifact
from ._common import artifact_dir, check_head_target, dtype_name, load_into, load_tensors, read_json, save_tensors, \
    write_json, written

__all__ = ["export_vllm_medusa", "load_vllm_medusa"]

FORMAT = "vllm"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def export_vllm_medusa(heads, target, out_dir, *, dtype: torch.dtype | None = None) -> dict:
    """Write ``heads`` (``MedusaHeads`` for ``target``) as vLLM's Medusa checkpoint; a report entry."""
    check_head_target(heads, target)
    a = heads.architecture
    K, n, H, V = heads.num_heads, int(a["num_layers"]), int(a["hidden_size"]), int(a["vocab_size"])
    Vd = heads.draft_vocab_size
    out_dtype = dtype or heads.dtype
    tensors = {}
    for i, head in enumerate(heads.heads):
        for j in range(n):
            tensors[f"blocks.{i}.layers.{j}.weight"] = head[j].linear.weight.detach().to("cpu", out_dtype)
            tensors[f"blocks.{i}.layers.{j}.bias"] = head[j].linear.bias.detach().to("cpu", out_dtype)
        tensors[f"lm_heads.{i}.weight"] = head[n].weight.detach().to("cpu", out_dtype)
    if heads.draft_to_target is not None:
        tensors["token_map"] = heads.draft_to_target.detach().to("cpu", torch.long)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": H,
        "vocab_size": V,
        "num_heads": int(K),
        "num_hidden_layers": n,
        "truncated_vocab_size": int(Vd),
        "medusa_fc_bias": True,
        "torch_dtype": dtype_name(out_dtype),
    }
    out = Path(out_dir)
    with artifact_dir(out, target, "medusa", FORMAT) as tmp:
        write_json(tmp / CONFIG_NAME, config)
        count = save_tensors(tensors, tmp / WEIGHTS_NAME)
    notes = [f"reduced vocabulary: {Vd} of {V} tokens (token_map)"] if Vd < V else []
    notes.append("vLLM drafts top-1 chains from these heads (the runtime's static tree is not recorded)")
    return written(FORMAT, "medusa", out, count, notes)


def load_vllm_medusa(directory, target, device=None, dtype=None, check_identity: bool = True):
    """Read a vLLM Medusa directory into the runtime's ``MedusaHeads`` for ``target`` (refused for
    another target unless ``check_identity=False``; a bad ``token_map`` is an ``ArtifactError``)."""
    from specfoundry.runtime.speculators import MedusaHeads
    from specfoundry.runtime.speculators.eagle import seeded_init

    directory = Path(directory)
    if check_identity:
        check_artifact(directory, target)
    file = directory / CONFIG_NAME
    cfg = read_json(file)
    if cfg.get("model_type") != "medusa":
        raise ArtifactError(f"{file}: model_type {cfg.get('model_type')!r} is not 'medusa'")
    for key in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
            raise ArtifactError(f"{file}: {key} missing or not an int")
    V = cfg["vocab_size"]
    Vd = cfg.get("truncated_vocab_size") or V
    arch = {"hidden_size": cfg["hidden_size"], "vocab_size": V, "num_heads": cfg["num_heads"],
            "num_layers": cfg["num_hidden_layers"], "feature_layers": [int(target.num_layers)]}
    if Vd != V:
        arch["draft_vocab_size"] = int(Vd)
    problems = MedusaHeads.architecture_problems(arch, target)
    if problems:
        raise ArtifactError(f"{file}: does not fit the target: " + "; ".join(f"{k}: {m}" for k, m in problems))
    weights = directory / WEIGHTS_NAME
    raw = load_tensors(weights)
    n, bias = arch["num_layers"], bool(cfg.get("medusa_fc_bias", False))
    ours = {}
    token_map = raw.pop("token_map", None)
    if Vd < V:
        if token_map is None:
            raise ArtifactError(f"{weights}: truncated_vocab_size {Vd} < vocab_size {V} but no token_map tensor")
        ours["d2t"] = token_map.view(-1)
        t2d = torch.zeros(V, dtype=torch.bool)
        if not token_map.is_floating_point() and token_map.dtype != torch.bool and token_map.numel() == Vd \
                and int(token_map.min()) >= 0 and int(token_map.max()) < V:
            t2d[token_map.long().view(-1)] = True
        ours["t2d"] = t2d
        for name, problem in MedusaHeads.tensor_problems(ours, arch):
            raise ArtifactError(f"{weights}: {name}: {problem}")
    for name, value in raw.items():
        parts = name.removeprefix("medusa_heads.").split(".")
        if len(parts) == 5 and parts[0] == "blocks" and parts[2] == "layers" and parts[4] in ("weight", "bias"):
            ours[f"heads.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = value
        elif len(parts) == 3 and parts[0] == "lm_heads" and parts[2] == "weight":
            ours[f"heads.{parts[1]}.{n}.weight"] = value
        else:
            raise ArtifactError(f"{weights}: unexpected tensor {name!r}")
    with seeded_init(0):
        heads = MedusaHeads.build(arch, target)
    heads = heads.to(dtype or target.dtype)
    if not bias:  # blocks without a bias: ours hold zeros there
        for i in range(arch["num_heads"]):
            for j in range(n):
                ours.setdefault(f"heads.{i}.{j}.linear.bias", torch.zeros(arch["hidden_size"]))
    load_into(heads, ours, weights, "Medusa heads")
    return heads.to(device or target.device).eval()
