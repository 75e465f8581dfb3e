"""Training data for speculators: prompts -> self-distilled, tokenized chat examples.

Scope: :func:`build_dataset` (prompt sources -> tokenized training ``datasets.Dataset`` and the
held-out eval prompts), :func:`make_example` and :func:`split_eval`. The pieces it composes live
apart, one concern each: prompt sources in :mod:`.prompts`, generation (the chat template as ids,
batched generation on the runtime's engine, self-distillation) in :mod:`.generation`, hashing and
the resumable chunk cache in :mod:`.datacache`. Their public names are re-exported here for
callers that import them from ``specfoundry.train.data``.

Columns of the training dataset: ``id`` (int), ``prompt`` (str), ``response`` (str),
``input_ids`` (list[int]), ``loss_mask`` (list[bool]), ``prompt_len`` (int).

Conventions: ``loss_mask[i]`` is True when token ``i`` is a training label (it is predicted
from positions ``< i``); by default only the assistant's tokens, including the end-of-turn
token the target emitted. Hidden states for these examples come from :mod:`.features`.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Sequence

from specfoundry.runtime.logs import stderr_logger

# (re-exported names: features.py and older callers import them from here)
from .datacache import (ChunkReport, GenStats, dtype_name, model_fingerprint, resolve_dtype,  # noqa: F401
                        save_dataset_atomic, stable_hash)
from .distill import DEFAULT_RESPONSES, responses_key_base, self_distill  # noqa: F401
from .generation import ChatFormat, generate_batched  # noqa: F401
from .prompts import MAGPIE_DEFAULTS, load_prompts

__all__ = ["build_dataset", "make_example", "split_eval", "TRAIN_FEATURES", "ChatFormat", "ChunkReport", "GenStats",
           "self_distill", "generate_batched", "stable_hash", "model_fingerprint", "resolve_dtype", "dtype_name"]


_log = stderr_logger(__name__)
# the most of ``build_dataset``'s time budget that prompt generation may take. The default recipe's
# prompts cost two fifths to half an answer's time: per kept Magpie prompt / per answer 0.12 / 0.25 s on a
# calm Zen 5 EPYC (Magpie 29% of the 7 minutes for all 976 prompts), 0.19 / 0.49 s on a 2-core Xeon without
# AMX (forty-first session), where 0.4 left 493 of 877 prompts unanswered when the budget ran out. A round
# starts only when it ends inside the share, so the Zen 5 needs some room above its 29% (0.35 at the 7-minute
# budget). With 8.5 minutes (forty-fifth session) 0.3 leaves it that room, and on the Xeon 0.35 had left 203
# of 897 prompts unanswered (0.19 / 0.46 s: the share that answers them all is ~0.29)
PROMPT_SHARE = 0.3


# ---------------------------------------------------------------------------------------------
# tokenized training examples
# ---------------------------------------------------------------------------------------------


def TRAIN_FEATURES():
    """Column types of the training dataset (explicit, so an empty dataset is typed too)."""
    from datasets import Features, List, Value

    return Features({"id": Value("int64"), "prompt": Value("string"), "response": Value("string"),
                     "input_ids": List(Value("int32")), "loss_mask": List(Value("bool")),
                     "prompt_len": Value("int32")})


def make_example(prompt_ids: Sequence[int], response_ids: Sequence[int], *, max_seq_len: int,
                 loss_on_prompt: bool = False) -> dict | None:
    """``input_ids`` = prompt + response truncated to ``max_seq_len``; ``loss_mask`` True on the
    response tokens (on every token but the first with ``loss_on_prompt``). None when no label
    survives truncation."""
    ids = (list(prompt_ids) + list(response_ids))[:max_seq_len]
    n_prompt = min(len(prompt_ids), len(ids))
    if loss_on_prompt:
        mask = [False] + [True] * (len(ids) - 1)  # token 0 has nothing before it to predict it from
    else:
        mask = [False] * n_prompt + [True] * (len(ids) - n_prompt)
    if not any(mask):
        return None
    return {"input_ids": ids, "loss_mask": mask, "prompt_len": n_prompt}


def split_eval(prompts: list[str], eval_prompts, seed: int) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: hold out ``eval_prompts`` prompts (an int count, a fraction < 1, or
    an explicit list of prompt strings, which are then removed from training).

    The held-out prompts are those with the smallest ``hash(seed, prompt)``, and both lists keep
    the input order: adding prompts later moves few prompts between the splits (the responses
    cache reuses every prompt answered before in any case; the trainer shuffles batches anyway)."""
    prompts = list(prompts)
    if isinstance(eval_prompts, (list, tuple)):
        held = list(eval_prompts)
        drop = set(held)
        return [p for p in prompts if p not in drop], held
    n = eval_prompts or 0
    if isinstance(n, float) and 0 < n < 1:
        n = int(round(n * len(prompts)))
    n = int(n)
    if n <= 0:
        return prompts, []
    if n >= len(prompts):
        raise ValueError(f"eval_prompts={eval_prompts} leaves no training prompts out of {len(prompts)}")
    ranked = sorted(range(len(prompts)), key=lambda i: hashlib.sha256(f"{seed}\x00{prompts[i]}".encode()).digest())
    held_idx = set(ranked[:n])
    return ([p for i, p in enumerate(prompts) if i not in held_idx],
            [p for i, p in enumerate(prompts) if i in held_idx])


def build_dataset(prompt_sources: list[dict], target, *, responses_cfg: dict | None = None, max_seq_len: int = 512,
                  eval_prompts=0, loss_on_prompt: bool = False, cache_dir: str | Path, seed: int = 0,
                  min_response_tokens: int = 16, max_minutes: float | None = None, stats: dict | None = None,
                  state_layers: Sequence[int] = ()):
    """Prompts from ``prompt_sources`` -> self-distilled, tokenized training examples.

    ``prompt_sources``: dicts, e.g. ``{"source": "magpie", "count": 2000}``,
    ``{"source": "file", "path": "data.jsonl", "limit": 500}``,
    ``{"source": "hub", "name": "org/set", "split": "train", "limit": 500}`` (see
    :func:`specfoundry.train.prompts.load_prompts`). Prompts are deduplicated across sources, a
    deterministic ``eval_prompts`` hold-out (see :func:`split_eval`; it comes out of the sources'
    counts) is split off before any response is generated, and
    prompts whose templated length leaves fewer than ``min_response_tokens`` of ``max_seq_len``
    are dropped. ``max_minutes`` is a wall budget for generation (Magpie rounds and response
    chunks; no Magpie round starts past ``PROMPT_SHARE`` of it, and the response chunk that would end past it is
    cut to the prompts expected to fit): past it nothing new is started and the dataset holds what is done (a rerun with
    more time continues from the cache; with several processes give the budget to the main one
    and ``max_minutes=0`` to the others, which then read exactly what it cached). ``stats``: a
    dict filled with what was planned and done (``prompts_asked`` (None when a source has no
    limit), ``prompts``, ``held_out``, ``to_distill``, ``chunks_skipped``, ``examples``,
    ``stopped_by_guard``: the budget left prompts or responses ungenerated). ``state_layers``: the
    generation keeps the target's states at those indices for the hidden-state store (see
    :func:`~specfoundry.train.distill.self_distill`). Returns
    ``(train_ds, eval_prompts_list)``; ``train_ds`` is saved under
    ``cache_dir/datasets/<hash>`` and memory-mapped from there.
    """
    from datasets import Dataset, load_from_disk

    cache_dir = Path(cache_dir)
    t0 = time.perf_counter()
    deadline = time.time() + 60 * max_minutes if max_minutes is not None else None
    # prompts get at most PROMPT_SHARE of the budget: a prompt without a response trains nothing,
    # and on a slow machine (emulated bf16) the Magpie rounds alone once ate the whole budget
    prompt_deadline = time.time() + 60 * max_minutes * PROMPT_SHARE if max_minutes is not None else None
    # (a round is declined when it would end past the deadline, so the clock alone cannot tell)
    prompt_guard = ChunkReport()
    prompts = load_prompts(prompt_sources, target=target, cache_dir=cache_dir, seed=seed, deadline=prompt_deadline,
                           guard=prompt_guard)
    train_prompts, held_out = split_eval(prompts, eval_prompts, seed)
    chat = ChatFormat(target)
    room = max_seq_len - min_response_tokens
    fits = [p for p in train_prompts if len(chat.prompt_ids(p, (responses_cfg or {}).get("system"))) <= room]
    if len(fits) < len(train_prompts):
        _log(f"dropped {len(train_prompts) - len(fits)} prompts longer than {room} templated tokens")
    _log(f"{len(prompts)} prompts: {len(fits)} to self-distill, {len(held_out)} held out for eval")
    report = ChunkReport()
    distilled = self_distill(fits, target, responses_cfg=responses_cfg, cache_dir=cache_dir, seed=seed, report=report,
                             deadline=deadline, state_layers=state_layers)
    _log(f"response chunks: {report.computed} generated, {report.reused} reused ({report.items_reused} prompts "
         f"answered before) from {cache_dir}"
         + (f", the last cut to {report.cut[0]} of {report.cut[1]} prompts" if report.cut else "")
         + (f", {report.skipped} skipped (max_minutes={max_minutes} reached)" if report.skipped else ""))

    # a plain list: a datasets Column would be hashed by its truncated repr (its first 5 prompts),
    # and a rerun that generated more responses would reuse the smaller dataset of the first run
    done_prompts = list(distilled["prompt"]) if distilled is not None else []
    key = stable_hash("dataset-v1", responses_key_base(target, {**DEFAULT_RESPONSES, **(responses_cfg or {})}, seed,
                                                       state_layers),
                      max_seq_len, loss_on_prompt, done_prompts)[:16]
    out = cache_dir / "datasets" / key
    if not (out / "dataset_info.json").exists():
        cols: dict[str, list] = {"id": [], "prompt": [], "response": [], "input_ids": [], "loss_mask": [],
                                 "prompt_len": []}
        if distilled is not None:
            for row in distilled:
                ex = make_example(row["prompt_ids"], row["response_ids"], max_seq_len=max_seq_len,
                                  loss_on_prompt=loss_on_prompt)
                if ex is None:
                    continue
                cols["id"].append(len(cols["id"]))
                cols["prompt"].append(row["prompt"])
                cols["response"].append(row["response"])
                for k in ("input_ids", "loss_mask", "prompt_len"):
                    cols[k].append(ex[k])
        if not cols["id"]:
            raise ValueError(
                f"no training examples: {len(prompts)} prompts, {len(fits)} to self-distill, "
                f"{report.computed + report.reused} response chunks done"
                + (f" within data.max_minutes={max_minutes} ({report.skipped} chunks left; what was generated "
                   f"is cached, so a rerun with a larger data.max_minutes continues from it)" if report.skipped else ""))
        save_dataset_atomic(Dataset.from_dict(cols, features=TRAIN_FEATURES()), out)
    ds = load_from_disk(str(out))
    if stats is not None:
        asked = [s.get("count", MAGPIE_DEFAULTS["count"]) if s.get("source") == "magpie" else s.get("limit")
                 for s in prompt_sources]
        asked_total = sum(asked) if all(a is not None for a in asked) else None
        stats.update(prompts_asked=asked_total, prompts=len(prompts), held_out=len(held_out), to_distill=len(fits),
                     chunks_skipped=report.skipped, examples=len(ds),
                     stopped_by_guard=bool(report.skipped or report.cut or prompt_guard.skipped))
    n_tok = sum(len(x) for x in ds["input_ids"]) if len(ds) else 0
    n_lab = sum(sum(x) for x in ds["loss_mask"]) if len(ds) else 0
    _log(f"dataset: {len(ds)} examples, {n_tok} tokens, {n_lab} label tokens "
         f"({time.perf_counter() - t0:.0f}s including generation) -> {out}")
    return ds, held_out
