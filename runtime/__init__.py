"""Embeddable lossless speculative-decoding runtime.

Depends on torch, safetensors and transformers only; never imports ``specfoundry.train``
or ``specfoundry.export``.

    from specfoundry.runtime import load_target, load_drafter, SpeculativeGenerator
    target = load_target("smollm2-135m")
    gen = SpeculativeGenerator(target, load_drafter("ngram", target=target))
    out = gen.generate(messages=[{"role": "user", "content": "..."}], max_new_tokens=128)
"""

from . import mkl_warmup
from .engine import EngineTarget, StaticKVCache
from .drafters import DraftContext, Drafter, LookupFirstDrafter, available_drafters, load_drafter, register_drafter
from .generator import GenerationOutput, GenerationStats, SpeculativeGenerator, StreamChunk
from .models import DEFAULT_TARGET, load_target, wrap_target
from .sampling import SamplingParams, probs_from_logits
from .target import KVCache, TargetModel, TargetOutput
from .tree import Draft
from .verify import VerifyResult, verify

mkl_warmup.warm()  # before any parallel op of ours can be MKL VML's first call (see the module)

__all__ = [
    "DEFAULT_TARGET", "Draft", "DraftContext", "Drafter", "EngineTarget", "GenerationOutput", "GenerationStats", "KVCache",
    "LookupFirstDrafter", "SamplingParams", "SpeculativeGenerator", "StaticKVCache", "StreamChunk", "TargetModel",
    "TargetOutput", "VerifyResult",
    "available_drafters", "load_drafter", "load_target", "probs_from_logits", "register_drafter", "verify",
    "wrap_target",
]
