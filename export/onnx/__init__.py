"""ONNX export of a target and its speculator, in two attention variants, with parity checks.

Scope: graphs with flat inputs and explicit KV for the target and for EAGLE/EAGLE-3/Medusa
speculators (:mod:`.graphs`), the ``specfoundry::TreeAttention`` op in its PyTorch, ONNX-node
and ONNX-reference forms (:mod:`.tree_attention`), the bit-packed tree mask shared with the
Triton kernel and the TensorRT plugin (:mod:`.tree_mask`), onnxruntime-backed stand-ins for
the runtime's target and drafters (:mod:`.ort`), and parity figures (:mod:`.parity`).

Variants (one interface, :func:`export_onnx`): ``"standard"`` uses opset-23 ``Attention`` with
a bool mask (plugin-free); ``"plugin"`` uses the custom node with ``plugin_namespace`` and a
model-local reference function. Files: ``<out>/target.<variant>.onnx``,
``<out>/speculator.<variant>.onnx`` (+ ``speculator.<variant>.fuse.onnx`` for EAGLE heads;
``<file>.data`` external weights when large).

Building TensorRT engines from these graphs is ``specfoundry.export.trt``.
"""

from .graphs import OPSET, VARIANTS, export_onnx, fuse_path, read_metadata
from .ort import OrtEagleDrafter, OrtEagleHead, OrtMedusaHeads, OrtTarget, load_ort_drafter
from .parity import NEAR_TIE, compare_greedy, export_all, graph_paths, greedy_end_to_end, parity_report
from .tree_attention import tree_attention, tree_attention_function_proto, tree_attention_reference
from .tree_mask import pack_tree_mask, tree_mask_words, unpack_tree_mask

__all__ = [
    "OPSET",
    "VARIANTS",
    "NEAR_TIE",
    "export_onnx",
    "export_all",
    "fuse_path",
    "graph_paths",
    "read_metadata",
    "parity_report",
    "greedy_end_to_end",
    "compare_greedy",
    "OrtTarget",
    "OrtEagleHead",
    "OrtEagleDrafter",
    "OrtMedusaHeads",
    "load_ort_drafter",
    "tree_attention",
    "tree_attention_reference",
    "tree_attention_function_proto",
    "pack_tree_mask",
    "unpack_tree_mask",
    "tree_mask_words",
]
