"""The ``specfoundry::TreeAttention`` operator: PyTorch custom op, ONNX node and ONNX reference.

Scope: one op contract in three forms that must agree.

Contract (shared with the Triton kernel and the TensorRT plugin)::

    TreeAttention(query [B, Hq, T, D], key [B, Hkv, P+T, D], value [B, Hkv, P+T, D],
                  tree_mask int32 [B, T, W]) -> out [B, Hq, T, D]        attribute scale: float

- ``W = ceil(T / 32)``, ``P = key.shape[2] - T`` (the past length; key/value hold the past
  entries followed by the ``T`` new ones, in order).
- New token ``i`` attends to every past position ``j < P`` and to new token ``t`` iff bit
  ``t % 32`` of ``tree_mask[b, i, t // 32]`` is set (bit-packed, TensorRT-LLM convention; see
  :mod:`.tree_mask`).
- GQA: ``Hq`` is a multiple of ``Hkv``; query head ``h`` reads kv head ``h // (Hq // Hkv)``.
- ``out = softmax(scale * q k^T, masked) v`` with scores, softmax and the weighted sum in fp32,
  cast back to the query dtype. Masked scores are the most negative finite fp32 (not -inf), so
  a row with nothing visible (never the case for a tree: a token sees itself) averages all
  positions instead of producing NaN; kernels may treat such rows as undefined.

Forms:

- :func:`tree_attention` = ``torch.ops.specfoundry.tree_attention``: a ``torch.library`` custom op
  with an eager reference and a fake (meta) kernel, so ``torch.export`` keeps it as one node.
- :func:`tree_attention_onnx`: the exporter translation (a plain function, not
  ``@onnxscript.script``: a scripted translation is inlined by the exporter's opset conversion
  and the custom node disappears) emitting one ``specfoundry::TreeAttention`` node with string
  attributes ``plugin_namespace="specfoundry"`` and ``plugin_version="1"`` (what TensorRT's
  ONNX parser looks for to pick a registered plugin).
- :func:`tree_attention_function_proto`: a model-local ONNX function with the reference body in
  standard ops, appended by :func:`attach_reference_function`; onnxruntime runs it on CPU and
  TensorRT imports it when no plugin is registered.
"""

from __future__ import annotations

import onnx
import torch
from onnx import TensorProto, helper
from onnx.defs import OpSchema

from .tree_mask import BITS, unpack_tree_mask

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "PLUGIN_NAMESPACE",
    "PLUGIN_VERSION",
    "tree_attention",
    "tree_attention_reference",
    "tree_attention_onnx",
    "tree_attention_function_proto",
    "attach_reference_function",
    "register_onnx_schema",
]

DOMAIN = "specfoundry"
OP_TYPE = "TreeAttention"
PLUGIN_NAMESPACE = "specfoundry"
PLUGIN_VERSION = "1"
DOMAIN_VERSION = 1

_NEG = torch.finfo(torch.float32).min


def tree_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Eager reference of the contract (module docstring), in plain torch."""
    B, Hq, T, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    P = S - T
    if P < 0 or Hq % Hkv or value.shape != key.shape:
        raise ValueError(f"bad TreeAttention shapes: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    new = unpack_tree_mask(tree_mask, T)  # [B, T, T]
    allowed = torch.cat([torch.ones(B, T, P, dtype=torch.bool, device=query.device), new.to(query.device)], dim=-1)
    g = Hq // Hkv
    k = key.float().repeat_interleave(g, dim=1)
    v = value.float().repeat_interleave(g, dim=1)
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], _NEG)
    return (torch.softmax(scores, dim=-1) @ v).to(query.dtype)


@torch.library.custom_op("specfoundry::tree_attention", mutates_args=())
def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``torch.ops.specfoundry.tree_attention``: see the module docstring for the contract."""
    return tree_attention_reference(query, key, value, tree_mask, scale)


@tree_attention.register_fake
def _tree_attention_fake(query, key, value, tree_mask, scale):
    return query.new_empty(query.shape)


# --------------------------------------------------------------------------- ONNX schema


def _build_schema() -> OpSchema:
    fp = OpSchema.FormalParameter
    return OpSchema(
        OP_TYPE,
        DOMAIN,
        DOMAIN_VERSION,
        "Tree attention over a KV cache with a bit-packed int32 tree mask (see specfoundry.export.onnx.tree_attention).",
        inputs=[fp("query", "T"), fp("key", "T"), fp("value", "T"), fp("tree_mask", "M")],
        outputs=[fp("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations"),
                          ("M", ["tensor(int32)"], "bit-packed tree mask")],
        attributes=[
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale", required=True),
            OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace", required=True),
            OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version", required=True),
        ],
    )


def register_onnx_schema() -> None:
    """Register the op's schema with ``onnx.defs`` (once per process): onnxscript looks custom
    ops up there, and ``onnx.checker`` accepts the domain."""
    try:
        onnx.defs.get_schema(OP_TYPE, DOMAIN_VERSION, DOMAIN)
    except onnx.defs.SchemaError:
        onnx.defs.register_schema(_build_schema())


register_onnx_schema()


def tree_attention_onnx(query, key, value, tree_mask, scale: float = 1.0):
    """Exporter translation of ``torch.ops.specfoundry.tree_attention``: one custom node.

    A plain function on purpose (see the module docstring)."""
    from onnxscript import values

    op = values.Opset(DOMAIN, DOMAIN_VERSION)
    return op.TreeAttention(query, key, value, tree_mask, scale=float(scale), plugin_namespace=PLUGIN_NAMESPACE,
                            plugin_version=PLUGIN_VERSION)


# --------------------------------------------------------------------------- reference body


def tree_attention_function_proto(opset: int = 23) -> onnx.FunctionProto:
    """The model-local ``specfoundry::TreeAttention`` function: the contract in standard ops
    (default-domain ``opset``, which must equal the model's)."""
    nodes = []

    def node(op, inputs, outputs, **attrs):
        nodes.append(helper.make_node(op, inputs, outputs, **attrs))
        return outputs[0]

    def const_i64(name, vals):
        return node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    def const_scalar(name, dtype, val):
        return node("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [val]))

    for i in range(5):
        const_i64(f"c{i}", [i])
    node("Shape", ["query"], ["qs"])
    node("Shape", ["key"], ["ks"])
    node("Slice", ["qs", "c0", "c1"], ["B"])
    node("Slice", ["qs", "c1", "c2"], ["Hq"])
    node("Slice", ["qs", "c2", "c3"], ["T"])
    node("Slice", ["qs", "c3", "c4"], ["D"])
    node("Slice", ["ks", "c1", "c2"], ["Hkv"])
    node("Slice", ["ks", "c2", "c3"], ["S"])
    node("Sub", ["S", "T"], ["P"])
    # unpack the bit mask: token t <-> bit t % 32 of word t // 32
    const_scalar("zero", TensorProto.INT64, 0)
    const_scalar("one", TensorProto.INT64, 1)
    const_scalar("bits", TensorProto.INT64, BITS)
    node("Squeeze", ["T", "c0"], ["T_scalar"])
    node("Range", ["zero", "T_scalar", "one"], ["idx"])
    node("Div", ["idx", "bits"], ["word"])
    node("Mod", ["idx", "bits"], ["bit"])
    pow2 = [(1 << b) - (1 << 32 if b == 31 else 0) for b in range(BITS)]  # int32 two's complement
    node("Constant", [], ["pow2"], value=helper.make_tensor("pow2", TensorProto.INT32, [BITS], pow2))
    node("Gather", ["pow2", "bit"], ["bitval"])  # [T]
    node("Gather", ["tree_mask", "word"], ["words"], axis=2)  # [B, T, T]
    node("BitwiseAnd", ["words", "bitval"], ["hit"])
    const_scalar("zero_i32", TensorProto.INT32, 0)
    node("Equal", ["hit", "zero_i32"], ["miss"])
    node("Not", ["miss"], ["new_ok"])
    # every past position is visible
    node("Concat", ["B", "T", "P"], ["past_shape"], axis=0)
    node("ConstantOfShape", ["past_shape"], ["past_ok"], value=helper.make_tensor("t", TensorProto.BOOL, [1], [True]))
    node("Concat", ["past_ok", "new_ok"], ["allowed3"], axis=2)
    node("Unsqueeze", ["allowed3", "c1"], ["allowed"])  # [B, 1, T, S]
    # GQA: repeat each kv head Hq / Hkv times (kv head h // G serves query head h)
    node("Div", ["Hq", "Hkv"], ["G"])
    node("Concat", ["B", "Hkv", "G", "S", "D"], ["shape5"], axis=0)
    node("Concat", ["B", "Hq", "S", "D"], ["shape4"], axis=0)
    for x in ("key", "value"):
        node("Unsqueeze", [x, "c2"], [f"{x}5"])
        node("Expand", [f"{x}5", "shape5"], [f"{x}5e"])
        node("Reshape", [f"{x}5e", "shape4"], [f"{x}_rep"])
        node("Cast", [f"{x}_rep"], [f"{x}_f"], to=TensorProto.FLOAT)
    node("Cast", ["query"], ["query_f"], to=TensorProto.FLOAT)
    # fp32 scores and softmax, whatever the activation dtype
    node("Transpose", ["key_f"], ["key_t"], perm=[0, 1, 3, 2])
    node("MatMul", ["query_f", "key_t"], ["qk"])
    scale_attr = helper.make_attribute_ref("value_float", onnx.AttributeProto.FLOAT)
    scale_attr.ref_attr_name = "scale"
    c = helper.make_node("Constant", [], ["scale_c"])
    c.attribute.append(scale_attr)
    nodes.append(c)
    node("Mul", ["qk", "scale_c"], ["scores"])
    const_scalar("neg", TensorProto.FLOAT, float(_NEG))
    node("Where", ["allowed", "scores", "neg"], ["masked"])
    node("Softmax", ["masked"], ["probs"], axis=-1)
    node("MatMul", ["probs", "value_f"], ["out_f"])
    node("CastLike", ["out_f", "query"], ["output"])
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["query", "key", "value", "tree_mask"],
        ["output"],
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        # plugin_namespace / plugin_version are declared so the node's attributes are legal
        # for the function; only `scale` is read by the body
        attributes=["scale", "plugin_namespace", "plugin_version"],
        doc_string="Reference body of specfoundry::TreeAttention (see specfoundry.export.onnx.tree_attention).",
    )


def attach_reference_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """Append the reference :func:`tree_attention_function_proto` to ``model`` (in place, also
    returned) when it uses the op and does not hold the function yet."""
    uses = any(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node)
    has = any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions)
    if uses and not has:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 23)
        model.functions.append(tree_attention_function_proto(opset))
        if not any(o.domain == DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model
