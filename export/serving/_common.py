"""Helpers shared by the serving-format writers and readers (not a public API).

Atomic artifact directories, safetensors I/O with clear errors, report entries, and the pieces
of the EAGLE heads' layouts that several formats share (Llama layer config, feature-layer and
draft-vocabulary canonicalisation).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from specfoundry.runtime.atomic import atomic_dir

from ..identity import IDENTITY_NAME, ArtifactError, read_json, write_identity  # noqa: F401 (read_json re-exported)

# ------------------------------------------------------------------------------ report entries


def kind_of(obj) -> str:
    """The speculator type of a head (``.type``) or ``"draft"`` for a language model."""
    kind = getattr(obj, "type", None)
    if isinstance(kind, str) and kind:
        return kind
    return "draft"


def skipped(fmt: str, kind: str, why: str) -> dict:
    """A report entry for a (format, type) pair that was not written, and why."""
    return {"format": fmt, "speculator_type": kind, "status": "skipped", "reason": why, "summary": f"skipped: {why}"}


def written(fmt: str, kind: str, out_dir: Path, tensors: int, notes: list[str] | None = None) -> dict:
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    nbytes = sum(p.stat().st_size for p in files)
    entry = {
        "format": fmt,
        "speculator_type": kind,
        "status": "written",
        "path": str(out_dir),
        "files": [str(p.relative_to(out_dir)) for p in files],
        "tensors": int(tensors),
        "bytes": int(nbytes),
    }
    entry["summary"] = f"written: {len(files)} files, {tensors} tensors, {nbytes} bytes in {out_dir}"
    if notes:
        entry["notes"] = list(notes)
    return entry


def check_head_target(head, target) -> None:
    """A head carries the identity of the target it was built for; exporting it beside another
    target is a caller error (the artifact's identity record would lie)."""
    ident = getattr(head, "target_identity", None)
    if ident is None:
        return
    given = target.identity()
    differ = [k for k in ("vocab_size", "hidden_size", "num_layers", "fingerprint") if ident[k] != given[k]]
    if differ:
        raise ValueError(f"this {kind_of(head)} head was built for target {ident.get('name')!r}, not "
                         f"{given.get('name')!r} (they differ in {', '.join(differ)})")


# ------------------------------------------------------------------------------ directories / files


@contextlib.contextmanager
def artifact_dir(out_dir, target, kind: str, fmt: str):
    """Yield a temporary sibling directory; on success it replaces ``out_dir`` in one rename.

    Readers never see a half-written artifact. An existing ``out_dir`` is replaced only when it
    is empty or an earlier specfoundry artifact (has ``specfoundry_target.json``).
    """
    with atomic_dir(out_dir, lambda p: (p / IDENTITY_NAME).exists(), "a specfoundry artifact directory") as tmp:
        yield tmp
        write_identity(tmp, target, kind, fmt)


def write_json(path: Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> int:
    from safetensors.torch import save_file

    # clone: safetensors refuses shared or non-contiguous storage, and must not see live parameters
    clean = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    check_finite(clean.items(), path)
    save_file(clean, str(path), metadata={"format": "pt", **(metadata or {})})
    return len(clean)


def check_finite(named_tensors, where) -> None:
    """Refuse (:class:`ArtifactError`) to export, or read back, non-finite weights: a serving
    engine would load them and generate garbage."""
    for name, t in named_tensors:
        if torch.is_tensor(t) and t.is_floating_point():
            bad = int((~torch.isfinite(t.detach())).sum())
            if bad:
                raise ArtifactError(f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN/inf); "
                                    "refusing to export corrupt or diverged weights")


def load_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: missing")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: unreadable safetensors file: {exc}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------ EAGLE layouts

# Llama decoder-layer keys every EAGLE config in these formats carries (HF LlamaConfig names).
_LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings")


def llama_layer_config(arch: dict) -> dict:
    """An HF ``LlamaConfig``-style dict (one decoder layer) for a head's architecture."""
    cfg = {"model_type": "llama", **{k: arch[k] for k in _LAYER_KEYS}}
    rope = dict(arch["rope_parameters"])
    cfg.update({
        "num_hidden_layers": 1,
        "rope_parameters": rope,
        # older readers (transformers < 5, SafeAILab code) look for rope_theta at the top level
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    })
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = dict(rope)
    return cfg


def arch_from_llama_config(cfg: dict, file, feature_layers: list[int]) -> dict:
    """The inverse of :func:`llama_layer_config` (plus the feature layers), with clear errors."""
    missing = [k for k in _LAYER_KEYS if k not in cfg and k != "head_dim"]
    if missing:
        raise ArtifactError(f"{file}: missing {', '.join(missing)}")
    if cfg.get("model_type", "llama") != "llama":
        raise ArtifactError(f"{file}: only Llama-architecture EAGLE layers are supported, got model_type {cfg.get('model_type')!r}")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ArtifactError(f"{file}: the runtime's EAGLE heads have one decoder layer, got num_hidden_layers={cfg['num_hidden_layers']}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ArtifactError(f"{file}: attention/MLP biases are not supported by the runtime's EAGLE heads")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = dict(rope)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    heads = int(cfg["num_attention_heads"])
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        "hidden_act": str(cfg["hidden_act"]),
        "rms_norm_eps": float(cfg["rms_norm_eps"]),
        "rope_parameters": rope,
        "max_position_embeddings": int(cfg["max_position_embeddings"]),
        "feature_layers": [int(i) for i in feature_layers],
    }


def default_eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high feature layers (inputs of layers 2, L//2, L-3), the default of
    vLLM, SGLang and the SafeAILab reference when a checkpoint names none."""
    L = int(num_layers)
    return [2, L // 2, L - 3]


def feature_order(layers, num_layers: int, lowest: int, fmt: str) -> tuple[list[int] | None, str | None]:
    """Serving engines collect the feature layers in ascending layer order: the permutation that
    sorts ``layers``, or ``(None, why)`` when the engine cannot represent them."""
    layers = [int(i) for i in layers]
    if len(set(layers)) != len(layers):
        return None, (f"{fmt} collects each target layer once, in layer order; this head reads feature layers "
                      f"{layers} with repeats (a tiny target's clamped defaults?)")
    bad = [i for i in layers if not lowest <= i < num_layers]
    if bad:
        return None, (f"{fmt} can only feed hidden_states indices {lowest}..{num_layers - 1} (layer inputs) to an "
                      f"EAGLE-3 head; this head reads {bad} (index {num_layers} is the final *normed* state)")
    return sorted(range(len(layers)), key=lambda j: layers[j]), None


def eagle3_fused_tensors(head, order: list[int], dtype) -> dict[str, torch.Tensor]:
    """``fc.weight`` with its column blocks and ``fc_norm.*`` permuted into ascending layer order."""
    H = head.hidden_size
    fc = head.fc.weight.detach()
    out = {"fc.weight": torch.cat([fc[:, j * H:(j + 1) * H] for j in order], dim=1)}
    for new, j in enumerate(order):
        out[f"fc_norm.{new}.weight"] = head.feature_norms[j].weight.detach()
    return {k: (v.to(dtype) if dtype is not None else v) for k, v in out.items()}


def sorted_draft_vocab(head, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t ascending absolute target ids, lm_head rows in that order)``.

    Engines (and the speculators trainer) keep the draft vocabulary sorted by target id; a
    permutation of draft ids changes nothing but the row order of ``lm_head``.
    """
    d2t = head.d2t.detach().to("cpu", torch.long)
    perm = torch.argsort(d2t)
    w = head.lm_head.weight.detach().to("cpu")[perm]
    return d2t[perm], (w.to(dtype) if dtype is not None else w)


def layer_tensors(head, prefix: str, dtype) -> dict[str, torch.Tensor]:
    """The decoder layer's tensors under ``prefix`` (``layers.0.`` / ``midlayer.``)."""
    out = {}
    for k, v in head.layer.state_dict().items():
        v = v.detach()
        out[prefix + k] = v.to(dtype) if (dtype is not None and v.is_floating_point()) else v
    return out


def load_into(module, tensors: dict[str, torch.Tensor], file, what: str) -> None:
    """Strict, shape-checked ``load_state_dict`` with errors that name the file and tensor."""
    expected = module.state_dict()
    for name in tensors:
        if name not in expected:
            raise ArtifactError(f"{file}: unexpected tensor {name!r} for {what}")
    for name, ref in expected.items():
        if name not in tensors:
            raise ArtifactError(f"{file}: missing tensor {name!r} for {what}")
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise ArtifactError(f"{file}: tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(ref.shape)}")
    check_finite(tensors.items(), file)
    module.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=True)
