"""Serving-format checkpoints: trained speculators written in the layouts serving engines read.

Scope: one writer and one reader per format, and :data:`SERVING_FORMATS`. Writers take a head
(``Eagle3Head``/``EagleHead``/``MedusaHeads``) or a draft LM (a runtime ``TargetModel``), the
target it belongs to and an output directory, write the directory atomically and return a
report entry::

    {"format", "speculator_type", "status": "written", "path", "files", "tensors", "bytes", "summary"}
    {"format", "speculator_type", "status": "skipped", "reason", "summary": "skipped: <why>"}

A type a format cannot carry is a ``skipped`` entry, never an exception. Readers load a
directory back into the runtime's module for a target (the round-trip tests run the runtime
on it) and refuse one exported for another target: every directory carries
``specfoundry_target.json`` (:mod:`specfoundry.export.identity`).

=========  ===============================================  ======================================
format     layout                                           types
=========  ===============================================  ======================================
vllm       vLLM's ``speculators`` format (Eagle3 config,    eagle3, medusa
           d2t as offsets, fc_norm); vLLM's Medusa layout
           (token_map for a reduced vocabulary)
sglang     SafeAILab EAGLE / EAGLE-3 layout (SGLang;        eagle, eagle3
           EAGLE-1 also vLLM ``method="eagle"``)
trtllm     TensorRT-LLM Medusa checkpoint; EAGLE-1 in the   medusa, eagle
           HF layout TRT-LLM's converter reads
hf_draft   plain HF model directory + tokenizer (our        draft
           ``draft`` drafter, HF assisted generation)
=========  ===============================================  ======================================

Not in scope: ONNX graphs and TensorRT engines (``specfoundry.export.onnx`` / ``.trt``), and
launching the engines (``specfoundry check-vllm``, ``bench/check_vllm.py``, serves a vLLM export end to end).
"""

from __future__ import annotations

from pathlib import Path

from .hf_draft import export_hf_draft, load_hf_draft
from .sglang import export_sglang, load_sglang
from .trtllm import export_trtllm, load_trtllm, medusa_choices
from .vllm import d2t_from_offsets, d2t_to_offsets, export_vllm, load_vllm

#: format name -> (writer, reader, speculator types it carries)
SERVING_FORMATS: dict[str, tuple] = {
    "vllm": (export_vllm, load_vllm, ("eagle3", "medusa")),
    "sglang": (export_sglang, load_sglang, ("eagle", "eagle3")),
    "trtllm": (export_trtllm, load_trtllm, ("medusa", "eagle")),
    "hf_draft": (export_hf_draft, load_hf_draft, ("draft",)),
}


def export_serving(obj, target, out_root, formats=None) -> list[dict]:
    """Write ``obj`` in each of ``formats`` (default: all) under ``out_root/<format>``; one report
    entry per format (``skipped`` where the format does not carry ``obj``'s type)."""
    names = list(SERVING_FORMATS) if formats is None else list(formats)
    unknown = [n for n in names if n not in SERVING_FORMATS]
    if unknown:
        raise ValueError(f"unknown serving format(s) {unknown}; known: {sorted(SERVING_FORMATS)}")
    # every writer answers an unsupported type with its own 'skipped' reason
    return [SERVING_FORMATS[name][0](obj, target, Path(out_root) / name) for name in names]


__all__ = [
    "SERVING_FORMATS",
    "d2t_from_offsets",
    "d2t_to_offsets",
    "export_hf_draft",
    "export_serving",
    "export_sglang",
    "export_trtllm",
    "export_vllm",
    "load_hf_draft",
    "load_sglang",
    "load_trtllm",
    "load_vllm",
    "medusa_choices",
]
