"""Self-distillation: the target answers the training prompts, cached chunk by chunk.

Scope: :func:`self_distill` (the answers as a ``datasets.Dataset``, resumable through
:func:`~specfoundry.train.datacache.cached_chunks`; optionally every answered prompt's target states,
:mod:`.genstates`), its defaults (:data:`DEFAULT_RESPONSES`), its cache identity
(:func:`responses_key_base`, :func:`states_dir`) and the greedy/sampled mix (:func:`sampled_in_mix`).
Generation itself is :func:`specfoundry.train.generation.generate_batched`, looked up on its module
at call time (tests count or interrupt the calls there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specfoundry.runtime.logs import stderr_logger

from . import generation as _generation
from .datacache import ChunkReport, cached_chunks, dtype_name, model_fingerprint, resolve_dtype, stable_hash
from .generation import ChatFormat, generation_model
from .genstates import write_states

__all__ = ["DEFAULT_RESPONSES", "sampled_in_mix", "responses_key_base", "states_dir", "self_distill"]

_log = stderr_logger(__name__)


# chunk_size: prompts per cached shard, and the granularity of resume and of the time budget; a
# few times the batch, so that finished prompts hand their slots to the next ones (continuous
# batching) for most of a chunk (192 prompts x ~140 tokens: ~40 s at ~700 tok/s, bf16, 2 cores)
DEFAULT_RESPONSES = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "batch_size": 32,
                     "dtype": None, "chunk_size": 192, "system": None, "sampled_fraction": 0.0,
                     "sampled_temperature": 1.0}


def sampled_in_mix(prompt: str, fraction: float) -> bool:
    """Whether ``prompt`` is one of the ``fraction`` of a greedy/sampled mix answered by sampling:
    decided by a hash of its text, so neither its chunk nor its position in the list changes it."""
    return fraction > 0 and int(stable_hash("sampled-mix", prompt)[:12], 16) < fraction * 16 ** 12


def responses_key_base(target, cfg: dict, seed: int, state_layers: Sequence[int] = ()) -> dict:
    gen_dtype = resolve_dtype(cfg["dtype"]) or target.dtype
    # batch_size is part of the key: batch composition changes padding and hence low-order bits,
    # and a resumed run must reproduce the interrupted one exactly (so are kept states: a finished
    # row stays one more forward for them)
    mix = ("sampled_fraction", "sampled_temperature") if cfg["sampled_fraction"] else ()  # (all-greedy keys unchanged)
    return {"kind": "responses-v2", "target": model_fingerprint(target), "template": ChatFormat(target).template_id(),
            "dtype": dtype_name(gen_dtype), "seed": seed,
            **{k: cfg[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "batch_size", "system") + mix},
            **({"states": [int(i) for i in state_layers]} if state_layers else {})}


def states_dir(cache_dir: str | Path, target, responses_cfg: dict | None, seed: int, state_layers: Sequence[int]) -> Path:
    """Where :func:`self_distill` with ``state_layers`` writes each answered prompt's target states
    (:mod:`.genstates`): one folder per responses configuration."""
    cfg = {**DEFAULT_RESPONSES, **(responses_cfg or {})}
    return Path(cache_dir) / "states" / stable_hash(responses_key_base(target, cfg, seed, state_layers))[:16]


def self_distill(prompts: Sequence[str], target, *, responses_cfg: dict | None = None, cache_dir: str | Path,
                 seed: int = 0, report: ChunkReport | None = None, deadline: float | None = None,
                 state_layers: Sequence[int] = ()):
    """The target's own answers to ``prompts``, as a ``datasets.Dataset`` with columns ``prompt``,
    ``prompt_ids``, ``response_ids``, ``response``, ``finished``; cached and resumable (see
    :func:`cached_chunks`). ``responses_cfg``: ``max_new_tokens``, ``temperature`` (0 = greedy),
    ``top_p``, ``top_k``, ``sampled_fraction`` / ``sampled_temperature`` (with temperature 0, that
    share of the prompts, see :func:`sampled_in_mix`, is sampled at that temperature), ``batch_size``,
    ``dtype`` (generation dtype; None = the target's),
    ``chunk_size`` (prompts per cached shard), ``system`` (system message; None = template
    default). Past ``deadline`` (``time.time()``) no new chunk starts: the result then covers
    only the prompts of the chunks done (``report.skipped`` counts the others). A prompt answered
    before with the same configuration is reused, whatever the list it came in.
    ``state_layers`` (where generation runs on the engine): every answered prompt's target states at
    those hidden-state indices, prompt and answer, are written under :func:`states_dir` as they come
    out of the generation's forwards (:mod:`.genstates`), for the hidden-state store to read instead
    of capturing them again. Elsewhere (a HF model) nothing is written and the store captures."""
    cfg = {**DEFAULT_RESPONSES, **(responses_cfg or {})}
    unknown = set(cfg) - set(DEFAULT_RESPONSES)
    if unknown:
        raise ValueError(f"unknown responses_cfg keys {sorted(unknown)}; known: {sorted(DEFAULT_RESPONSES)}")
    if cfg["sampled_fraction"] and cfg["temperature"]:
        raise ValueError(f"sampled_fraction {cfg['sampled_fraction']} mixes sampled answers into greedy ones: "
                         f"temperature must be 0, got {cfg['temperature']}")
    gen_dtype = resolve_dtype(cfg["dtype"]) or target.dtype
    chat = ChatFormat(target)
    model = generation_model(target, gen_dtype)
    stop = chat.assistant_stop_ids
    from specfoundry.runtime.engine import LlamaEngine

    state_layers = tuple(int(i) for i in state_layers) if isinstance(model, LlamaEngine) else ()
    key_base = responses_key_base(target, cfg, seed, state_layers)
    keep_dir = states_dir(cache_dir, target, cfg, seed, state_layers) if state_layers else None
    report = report if report is not None else ChunkReport()

    def compute(chunk: list[str], chunk_seed: int) -> dict[str, list]:
        pids = [chat.prompt_ids(p, cfg["system"]) for p in chunk]
        mix = [sampled_in_mix(p, cfg["sampled_fraction"]) for p in chunk] if cfg["sampled_fraction"] else None
        temperature = cfg["sampled_temperature"] if mix is not None else cfg["temperature"]
        kept: dict[int, torch.Tensor] = {}
        new, fin = _generation.generate_batched(
            model, pids, max_new_tokens=cfg["max_new_tokens"], temperature=temperature, top_p=cfg["top_p"],
            top_k=cfg["top_k"], stop_ids=stop, batch_size=cfg["batch_size"], pad_id=chat.pad_id, seed=chunk_seed,
            progress="responses", stats=report.stats, sampled=mix, state_layers=state_layers,
            on_states=kept.__setitem__ if state_layers else None)
        for i, states in kept.items():
            write_states(keep_dir, chunk[i], pids[i] + new[i], states, state_layers)
        return {"prompt": list(chunk), "prompt_ids": pids, "response_ids": new,
                "response": [chat.decode(r) for r in new], "finished": fin}

    ds = cached_chunks(Path(cache_dir) / "responses" / stable_hash(key_base)[:16], list(prompts), cfg["chunk_size"],
                       key_base, compute, desc="self-distill", report=report, deadline=deadline, item_column="prompt")
    if report.stats.seconds:
        _log(f"self-distillation ({dtype_name(gen_dtype)}, batch {cfg['batch_size']}): {report.stats.summary()}")
    return ds
