"""Draft language models as plain Hugging Face model directories: writer :func:`export_hf_draft`,
reader :func:`load_hf_draft`.

Scope: the ``"draft"`` speculator type (a distilled or layer-subset draft LM sharing the
target's tokenizer). The directory is what ``save_pretrained`` writes (``config.json``,
``generation_config.json``, ``model.safetensors``) plus the tokenizer files and our
``specfoundry_target.json``. It loads, unchanged, in:

- our runtime's ``draft`` drafter (``load_drafter(dir, target)``),
- transformers' assisted generation (``target.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(dir))``),
- vLLM (``speculative_config={"method": "draft_model", "model": dir}``), SGLang
  (``--speculative-algorithm STANDALONE``) and TRT-LLM draft-target decoding, which all take
  an HF directory.

Speculator heads are not standalone language models: ``skipped``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..identity import check_artifact
from ._common import artifact_dir, kind_of, skipped, written

__all__ = ["FORMAT", "SUPPORTED_TYPES", "export_hf_draft", "load_hf_draft"]

FORMAT = "hf_draft"
SUPPORTED_TYPES = ("draft",)


def _model_and_tokenizer(lm):
    from specfoundry.runtime.target import TargetModel

    if isinstance(lm, TargetModel):
        return lm.model, lm.tokenizer
    # a transformers causal LM (checked before `.model`: LlamaForCausalLM.model is its trunk)
    if hasattr(lm, "save_pretrained") and callable(getattr(lm, "get_output_embeddings", None)) \
            and lm.get_output_embeddings() is not None:
        return lm, None
    return None, None


def export_hf_draft(lm, target, out_dir, *, tokenizer=None, dtype: torch.dtype | None = None) -> dict:
    """Write a draft LM (a runtime ``TargetModel`` or a transformers causal LM) for ``target`` as an
    HF directory with its tokenizer (``tokenizer``, else the LM's, else the target's).

    The LM must share the target's vocabulary (and tokenizer, when both have one): a draft that
    does not cannot be verified token for token. Returns a report entry.
    """
    kind = kind_of(lm)
    model, own_tok = _model_and_tokenizer(lm)
    if kind != "draft" or model is None:
        return skipped(FORMAT, kind, "not a standalone language model (speculator heads need the target's hidden "
                                     "states); export a serving format for the head instead")
    vocab = model.get_output_embeddings().weight.shape[0]
    if vocab != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({vocab}) differs from the target's ({target.vocab_size})")
    tok = tokenizer or own_tok or target.tokenizer
    if tok is not None and target.tokenizer is not None and tok.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the target's tokenizer")
    from ._common import check_finite

    check_finite(model.state_dict().items(), out_dir)
    current = next(model.parameters()).dtype
    if dtype is not None and dtype != current:
        model = copy.deepcopy(model).to(dtype)  # never cast the caller's live model
    notes = []
    out = Path(out_dir)
    with artifact_dir(out, target, "draft", FORMAT) as tmp:
        model.save_pretrained(tmp)  # safetensors (transformers >= 5 writes nothing else)
        if tok is not None:
            tok.save_pretrained(tmp)
        else:
            notes.append("no tokenizer: neither the draft nor the target has one (ids-only use)")
    from safetensors import safe_open

    tensors = 0
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors += len(list(h.keys()))
    return written(FORMAT, "draft", out, tensors, notes)


def load_hf_draft(directory, target, device=None, dtype=None, check_identity: bool = True):
    """Load an exported draft directory as a runtime ``TargetModel`` (what the ``draft`` drafter
    runs), refused for another target unless ``check_identity=False``."""
    from specfoundry.runtime.models import load_target

    if check_identity:
        check_artifact(directory, target)
    lm = load_target(str(directory), device=device or target.device, dtype=dtype or target.dtype)
    if lm.vocab_size != target.vocab_size:
        raise ValueError(f"{directory}: draft vocabulary {lm.vocab_size} != target vocabulary {target.vocab_size}")
    return lm
