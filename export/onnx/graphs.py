"""Exportable graphs for the target and the speculators, and :func:`export_onnx`.

Scope: flat-input ``nn.Module`` wrappers around the runtime's own modules (HF decoder layers of
the target, EAGLE/EAGLE-3 heads, Medusa heads) and their ONNX export with the dynamo exporter
at opset 23. Running the graphs (onnxruntime) is :mod:`.ort`; parity figures are :mod:`.parity`.

Both attention variants share one graph interface (inputs, outputs, semantics); only the mask
input's encoding and the attention node differ:

- ``standard``: ``tree_mask`` bool ``[B, T, T]``; attention is SDPA with a 4-D bool mask, which
  exports to one opset-23 ``Attention`` node per layer (TensorRT >= 10.14 maps it to fused
  attention; no plugin).
- ``plugin``: ``tree_mask`` int32 ``[B, T, W]`` bit-packed (:mod:`.tree_mask`); attention is one
  ``specfoundry::TreeAttention`` node per layer (:mod:`.tree_attention`) with a model-local
  reference function, so onnxruntime runs it and TensorRT falls back to it without the plugin.

In both, new token ``i`` sees every past position and the new tokens its mask row allows; KV
inputs are ``past_key_values.{l}.key|value`` ``[B, Hkv, P, D]`` and outputs
``present.{l}.key|value`` ``[B, Hkv, P+T, D]`` (past followed by the new entries, the usual
optimum/onnxruntime-genai layout). Dynamic dims: batch, new tokens ``T``, past ``P`` (and ``W``).

Graphs (``metadata_props["specfoundry"]`` holds a JSON description read by :mod:`.ort`):

- target: ``input_ids [B,T]``, ``position_ids [B,T]``, ``tree_mask``, past KV per layer ->
  ``logits [B,T,V]``, ``hidden_states [B,T,F,H]`` (HF ``hidden_states`` indices
  ``feature_layers``: 0 = embeddings, i = input of layer i, L = final normed; omitted when no
  layers are requested), present KV.
- EAGLE step: ``input_ids [B,T]`` (the *next* tokens), ``hidden [B,T,H]`` (fused features or
  earlier head outputs), ``position_ids``, ``tree_mask``, the head's past KV -> ``hidden_out
  [B,T,H]``, ``logits [B,T,Vd]`` (draft vocabulary), present KV. The step's ``hidden`` is the
  fused target feature for committed tokens but the head's own output while drafting, so the
  fusion cannot sit inside the step: it is a second, attention-free graph
  ``<name>.fuse.onnx``: ``features [B,T,F,H]`` -> ``hidden [B,T,H]``.
- Medusa: ``hidden [B,T,H]`` -> ``logits [B,T,K,V]`` (no attention: both variants identical).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface

from specfoundry.runtime.speculators import Eagle3Head, EagleHead, MedusaHeads
from specfoundry.runtime.target import TargetModel, hf_cache_kw

from . import tree_attention as _ta
from .tree_mask import pack_tree_mask

__all__ = ["VARIANTS", "OPSET", "export_onnx", "fuse_path", "read_metadata", "TargetGraph", "EagleStepGraph",
           "EagleFuseGraph", "MedusaGraph"]

VARIANTS = ("standard", "plugin")
OPSET = 23
METADATA_KEY = "specfoundry"
_ATTN = {"standard": "specfoundry_onnx_standard", "plugin": "specfoundry_onnx_plugin"}
# graphs above this many bytes of weights keep them in `<file>.onnx.data` (protobuf caps a file
# at 2 GiB; engine builders read external data fine)
EXTERNAL_DATA_BYTES = 1 << 30


# --------------------------------------------------------------------------- attention


def _standard_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: SDPA with the 4-D bool mask the graph built."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _plugin_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: the TreeAttention custom op; ``attention_mask`` is the
    graph's packed int32 ``[B, T, W]`` mask."""
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = torch.ops.specfoundry.tree_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(_ATTN["standard"], _standard_attention)
AttentionInterface.register(_ATTN["plugin"], _plugin_attention)


@contextlib.contextmanager
def _attention_implementation(module: nn.Module, variant: str):
    """Temporarily route every HF attention module under ``module`` to the variant's function
    (the upstream layers run unchanged; only the attention kernel is swapped)."""
    configs = {}
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            configs[id(cfg)] = cfg
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = _ATTN[variant]
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]


class _FlatCache:
    """The one cache method HF attention calls (``update``), over flat past tensors: returns past
    + new and records them as the present outputs."""

    def __init__(self, past: list[torch.Tensor]):
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key, value, layer_idx, *args, **kwargs):
        k = torch.cat([self.past[2 * layer_idx], key], dim=2)
        v = torch.cat([self.past[2 * layer_idx + 1], value], dim=2)
        self.present[layer_idx] = (k, v)
        return k, v

    def outputs(self) -> list[torch.Tensor]:
        return [t for i in range(len(self.present)) for t in self.present[i]]


def _graph_mask(tree_mask: torch.Tensor, past_len, variant: str) -> torch.Tensor:
    """The graph's ``tree_mask`` input -> what the variant's attention function takes."""
    if variant == "plugin":
        return tree_mask  # the op reads the packed mask and the past length itself
    B, T = tree_mask.shape[0], tree_mask.shape[1]
    past = torch.ones(B, T, past_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([past, tree_mask], dim=-1).unsqueeze(1)  # [B, 1, T, P+T]


# --------------------------------------------------------------------------- wrappers


class TargetGraph(nn.Module):
    """The target's forward with flat inputs (module docstring). Composes the HF model's own
    embedding, rotary embedding, decoder layers, final norm and LM head; the HF ``forward`` is
    bypassed only so the mask reaches attention as given (no mask construction)."""

    def __init__(self, target: TargetModel, feature_layers=(), variant: str = "standard"):
        super().__init__()
        self.model = target.model
        self.backbone = target.model.model
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.variant = variant
        self.num_layers = target.num_layers
        bad = [i for i in self.feature_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} outside [0, {self.num_layers}]")

    def forward(self, input_ids, position_ids, tree_mask, *past):
        m = self.backbone
        cache = _FlatCache(list(past))
        mask = _graph_mask(tree_mask, past[0].shape[2], self.variant)
        h = m.embed_tokens(input_ids)
        pos_emb = m.rotary_emb(h, position_ids)
        hidden_states = [h]  # HF numbering: 0 = embeddings, i = input of layer i
        for layer in m.layers[: self.num_layers]:
            h = layer(h, attention_mask=mask, position_ids=position_ids, use_cache=True, **hf_cache_kw(cache),
                      position_embeddings=pos_emb)
            hidden_states.append(h)
        h = m.norm(h)
        hidden_states[-1] = h  # index L is the final *normed* state (what lm_head reads)
        logits = self.model.get_output_embeddings()(h)
        outs = [logits]
        if self.feature_layers:
            outs.append(torch.stack([hidden_states[i] for i in self.feature_layers], dim=2))
        return (*outs, *cache.outputs())


class EagleStepGraph(nn.Module):
    """One EAGLE/EAGLE-3 head step with flat inputs: the head's rotary embedding, its
    ``_decode`` (embedding + fc/layer) and ``compute_logits``. ``head.forward`` is not used
    because it converts masks to additive floats and keeps runtime cache bookkeeping."""

    def __init__(self, head, variant: str = "standard"):
        super().__init__()
        self.head = head
        self.variant = variant

    def forward(self, input_ids, hidden, position_ids, tree_mask, past_key, past_value):
        head = self.head
        cache = _FlatCache([past_key, past_value])
        mask = _graph_mask(tree_mask, past_key.shape[2], self.variant)
        pos_emb = head.rotary_emb(hidden, position_ids)
        out = head._decode(input_ids, hidden, attention_mask=mask, position_ids=position_ids, use_cache=True,
                           position_embeddings=pos_emb, **hf_cache_kw(cache))
        return (out, head.compute_logits(out), *cache.outputs())


class EagleFuseGraph(nn.Module):
    """EAGLE feature fusion: target features ``[B,T,F,H]`` -> step hidden ``[B,T,H]``."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, features):
        return self.head.fuse_features(features)


class MedusaGraph(nn.Module):
    def __init__(self, heads: MedusaHeads):
        super().__init__()
        self.heads = heads

    def forward(self, hidden):
        return self.heads(hidden)


# --------------------------------------------------------------------------- export


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _example(B, T, P, variant, device):
    """Example tensors for tracing: sizes chosen != 0/1 (export specialises those) and T > 32
    so the packed mask's word count W is 2, not a specialisable 1."""
    ids = torch.zeros(B, T, dtype=torch.long, device=device)
    pos = (P + torch.arange(T, device=device)).expand(B, T).contiguous()
    tril = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    mask = tril.contiguous() if variant == "standard" else pack_tree_mask(tril)
    return ids, pos, mask


def _mask_spec():
    # [B, T, T] bool or [B, T, W] int32; W is its own dim (ceil(T/32) is not expressible)
    D = torch.export.Dim.DYNAMIC
    return {0: D, 1: D, 2: D}


def _kv_names(n_layers: int, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def _run_export(module: nn.Module, args: tuple, dynamic_shapes, input_names, output_names, *,
                custom: bool) -> "torch.onnx.ONNXProgram":
    table = {torch.ops.specfoundry.tree_attention.default: _ta.tree_attention_onnx} if custom else None
    # the exporter prints progress and logs one warning per missing torchvision op: keep the
    # caller's output clean (errors still raise)
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, dynamic_shapes=dynamic_shapes,
                                     input_names=input_names, output_names=output_names,
                                     custom_translation_table=table, verbose=False)
    finally:
        quiet.setLevel(level)


# readable, consistent names for the dynamic dims of graph inputs/outputs (the exporter's are
# s0, s1, ... and differ between inputs it cannot relate, e.g. the packed mask's batch)
_IO_DIMS = {
    "input_ids": ("batch", "new_tokens"),
    "position_ids": ("batch", "new_tokens"),
    "hidden": ("batch", "new_tokens", None),
    "features": ("batch", "new_tokens", None, None),
    "past": ("batch", None, "past", None),
    "logits": ("batch", "new_tokens", None, None),
    "hidden_states": ("batch", "new_tokens", None, None),
    "hidden_out": ("batch", "new_tokens", None),
    "present": ("batch", None, "past + new_tokens", None),
}


def _dim_names(value_name: str, variant: str | None):
    if value_name == "tree_mask":
        return ("batch", "new_tokens", "mask_words" if variant == "plugin" else "new_tokens")
    if value_name.startswith("past_key_values."):
        return _IO_DIMS["past"]
    if value_name.startswith("present."):
        return _IO_DIMS["present"]
    return _IO_DIMS.get(value_name)


def _name_dims(model, variant: str | None) -> None:
    """Rename the symbolic dims of inputs/outputs (and the same symbols inside the graph)."""
    import re

    from onnxscript import ir

    rename = {}
    for v in model.graph.inputs:
        names = _dim_names(v.name, variant)
        if v.shape is None or names is None:
            continue
        for d, new in zip(v.shape, names):
            if isinstance(d, ir.SymbolicDim) and d.value and new:
                rename.setdefault(d.value, new)
    if not rename:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(rename, key=len, reverse=True)) + r")\b")

    def fix(v, names=None):
        if v.shape is None:
            return
        dims = []
        for i, d in enumerate(v.shape):
            if names is not None and i < len(names) and names[i] and not isinstance(d, int):
                dims.append(names[i])
            elif isinstance(d, ir.SymbolicDim) and d.value:
                dims.append(pattern.sub(lambda m: rename[m.group(1)], d.value))
            else:
                dims.append(d)
        v.shape = ir.Shape(dims)

    for node in model.graph.all_nodes():
        for o in node.outputs:
            fix(o)
    for v in (*model.graph.inputs, *model.graph.outputs):
        fix(v, _dim_names(v.name, variant))


def _finish(prog, path: Path, meta: dict, external_data: bool | None) -> dict:
    """Append the reference function (plugin variant), name dims, record metadata, save; returns
    facts for the export report."""
    from onnxscript import ir

    model = prog.model
    _name_dims(model, meta.get("variant"))
    uses_custom = any(n.domain == _ta.DOMAIN and n.op_type == _ta.OP_TYPE for n in model.graph.all_nodes())
    if uses_custom:
        opset = model.opset_imports.get("", OPSET)
        fn = ir.serde.deserialize_function(_ta.tree_attention_function_proto(opset))
        model.functions[fn.identifier()] = fn
        model.opset_imports.setdefault(_ta.DOMAIN, _ta.DOMAIN_VERSION)
    model.metadata_props[METADATA_KEY] = json.dumps(meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbytes = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    ext = nbytes > EXTERNAL_DATA_BYTES if external_data is None else bool(external_data)
    data = path.with_name(path.name + ".data")
    if data.exists():
        data.unlink()  # a stale weights file would be misleading next to a graph that inlines them
    prog.save(str(path), external_data=ext)
    ops: dict[str, int] = {}
    for n in model.graph.all_nodes():
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        ops[key] = ops.get(key, 0) + 1
    return {
        "path": str(path),
        "external_data": str(data) if ext else None,
        "weight_bytes": int(nbytes),
        "inputs": {v.name: _shape_list(v) for v in model.graph.inputs},
        "outputs": {v.name: _shape_list(v) for v in model.graph.outputs},
        "op_counts": dict(sorted(ops.items())),
        "opset": model.opset_imports.get("", None),
        "metadata": meta,
    }


def _shape_list(v) -> list:
    return [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def export_onnx(module_or_target, out_path, variant: str = "standard", *, feature_layers=(),
                external_data: bool | None = None) -> dict:
    """Export a target (:class:`TargetModel`), an EAGLE/EAGLE-3 head or Medusa heads to ONNX.

    ``variant``: ``"standard"`` (opset-23 ``Attention``) or ``"plugin"``
    (``specfoundry::TreeAttention`` + reference function); see the module docstring for the
    graph interface. ``feature_layers``: target hidden-state indices to output (targets only;
    usually the speculator's ``feature_layers``). EAGLE heads also write the fusion graph next
    to ``out_path`` (``.onnx`` -> ``.fuse.onnx``). ``external_data``: None = only above
    :data:`EXTERNAL_DATA_BYTES` of weights. Returns a report dict (paths, inputs, outputs, op
    counts, metadata); EAGLE heads add ``"fuse"`` with the fusion graph's.
    """
    _check_variant(variant)
    obj = module_or_target
    path = Path(out_path)
    D = torch.export.Dim.DYNAMIC
    B, T, P = 2, 33, 5
    if isinstance(obj, TargetModel):
        if obj.dtype == torch.float64:
            raise ValueError("export a float32/float16/bfloat16 target (onnxruntime has no float64 attention)")
        cfg = obj.config
        L = obj.num_layers
        Hkv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        Dh = int(getattr(cfg, "head_dim", None) or obj.hidden_size // cfg.num_attention_heads)
        dev, dt = obj.device, obj.dtype
        ids, pos, mask = _example(B, T, P, variant, dev)
        past = [torch.zeros(B, Hkv, P, Dh, dtype=dt, device=dev) for _ in range(2 * L)]
        graph = TargetGraph(obj, feature_layers, variant)
        kv_spec = {0: D, 2: D}
        # torch.export groups `*past` into one entry of dynamic_shapes
        shapes = ({0: D, 1: D}, {0: D, 1: D}, _mask_spec(), tuple([kv_spec] * (2 * L)))
        in_names = ["input_ids", "position_ids", "tree_mask", *_kv_names(L, "past_key_values")]
        out_names = ["logits"] + (["hidden_states"] if graph.feature_layers else []) + _kv_names(L, "present")
        meta = {"kind": "target", "variant": variant, "num_layers": L, "num_kv_heads": Hkv, "head_dim": Dh,
                "hidden_size": obj.hidden_size, "vocab_size": obj.vocab_size, "feature_layers": list(graph.feature_layers),
                "dtype": _dtype_name(dt), "mask": _mask_kind(variant), "target": obj.identity()}
        with _attention_implementation(obj.model, variant), torch.no_grad():
            prog = _run_export(graph, (ids, pos, mask, *past), shapes, in_names, out_names, custom=variant == "plugin")
        return _finish(prog, path, meta, external_data)

    if isinstance(obj, (EagleHead, Eagle3Head)):
        head = obj.eval()
        a = head.architecture
        Hkv, Dh, H = a["num_key_value_heads"], a["head_dim"], a["hidden_size"]
        dev, dt = head.device, head.dtype
        ids, pos, mask = _example(B, T, P, variant, dev)
        hidden = torch.zeros(B, T, H, dtype=dt, device=dev)
        past = [torch.zeros(B, Hkv, P, Dh, dtype=dt, device=dev) for _ in range(2)]
        kv_spec = {0: D, 2: D}
        shapes = ({0: D, 1: D}, {0: D, 1: D}, {0: D, 1: D}, _mask_spec(), kv_spec, kv_spec)
        d2t = head.draft_to_target
        meta = {"kind": head.type, "variant": variant, "num_layers": 1, "num_kv_heads": Hkv, "head_dim": Dh,
                "hidden_size": H, "vocab_size": a["vocab_size"], "draft_vocab_size": head.draft_vocab_size,
                "feature_layers": list(head.feature_layers), "dtype": _dtype_name(dt), "mask": _mask_kind(variant),
                "architecture": a, "d2t": None if d2t is None else [int(i) for i in d2t.tolist()],
                "target": head.target_identity}
        with _attention_implementation(head, variant), torch.no_grad():
            prog = _run_export(EagleStepGraph(head, variant), (ids, hidden, pos, mask, *past), shapes,
                               ["input_ids", "hidden", "position_ids", "tree_mask", *_kv_names(1, "past_key_values")],
                               ["hidden_out", "logits", *_kv_names(1, "present")], custom=variant == "plugin")
        report = _finish(prog, path, meta, external_data)
        F = len(head.feature_layers)
        feats = torch.zeros(B, T, F, H, dtype=dt, device=dev)
        with torch.no_grad():
            fprog = _run_export(EagleFuseGraph(head), (feats,), ({0: D, 1: D},), ["features"], ["hidden"], custom=False)
        fmeta = {"kind": f"{head.type}_fuse", "feature_layers": list(head.feature_layers), "hidden_size": H,
                 "dtype": _dtype_name(dt), "target": head.target_identity}
        report["fuse"] = _finish(fprog, fuse_path(path), fmeta, external_data)
        return report

    if isinstance(obj, MedusaHeads):
        heads = obj.eval()
        a = heads.architecture
        hidden = torch.zeros(B, T, a["hidden_size"], dtype=heads.dtype, device=heads.device)
        meta = {"kind": "medusa", "variant": variant, "num_heads": heads.num_heads, "hidden_size": a["hidden_size"],
                "vocab_size": a["vocab_size"], "feature_layers": list(heads.feature_layers),
                "dtype": _dtype_name(heads.dtype), "architecture": a, "target": heads.target_identity,
                # reduced-vocabulary heads: the graph's logits are over these target ids
                "d2t": None if heads.draft_to_target is None else [int(i) for i in heads.draft_to_target.tolist()],
                "choices": heads.tree_choices()}  # the static tree it drafts (the checkpoint's own)
        with torch.no_grad():
            prog = _run_export(MedusaGraph(heads), (hidden,), ({0: D, 1: D},), ["hidden"], ["logits"], custom=False)
        return _finish(prog, path, meta, external_data)

    raise TypeError(f"cannot export {type(obj).__name__}: expected a TargetModel, EagleHead, Eagle3Head or MedusaHeads")


def _mask_kind(variant: str) -> str:
    return "bool[B,T,T]" if variant == "standard" else "int32[B,T,ceil(T/32)] bit-packed"


def fuse_path(step_path) -> Path:
    """Where :func:`export_onnx` writes an EAGLE head's fusion graph for step graph ``step_path``."""
    p = Path(step_path)
    name = p.name[:-5] if p.name.endswith(".onnx") else p.name
    return p.with_name(name + ".fuse.onnx")


def read_metadata(model_or_path) -> dict:
    """The ``specfoundry`` metadata JSON of an exported graph (path or ``onnx.ModelProto``)."""
    import onnx

    model = model_or_path
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model_or_path), load_external_data=False)
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            return json.loads(p.value)
    raise ValueError(f"{model_or_path}: not a specfoundry ONNX export (no '{METADATA_KEY}' metadata)")
