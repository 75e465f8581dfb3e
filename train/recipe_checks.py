"""Cross-field checks of a recipe: the rules no single field's type or range can state.

Scope: :func:`cross_check` (run by the schema's recipe-level validator, so every recipe that
validates has passed it) and the run-directory rule (:func:`output_dir_problems`). Works on any
object shaped like :class:`~specfoundry.train.recipe_schema.Recipe` and does not import the
schema (the schema imports this module). No torch import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .launcher import launcher_problems
from .recipe_errors import suggest

__all__ = ["BUILTIN_HELDOUT", "cross_check", "output_dir_problems"]

BUILTIN_HELDOUT = "builtin-heldout"


def output_dir_problems(output_dir: str | None, cwd: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """A run writes only where it was told: a relative ``output_dir`` must stay inside the working
    directory (the project under ``make``); leaving it takes an explicit absolute path. An existing
    file is never a run directory."""
    if output_dir is None:
        return []
    p = Path(output_dir).expanduser()
    base = Path(cwd or os.getcwd()).resolve()
    full = p if p.is_absolute() else base / p
    if full.exists() and not full.is_dir():
        return [("output_dir", f"{output_dir!r} is an existing file, not a run directory")]
    if not p.is_absolute():
        # lexically (``..`` parts), not through symlinks: a ``runs/`` linked to a larger disk is fine
        lexical = Path(os.path.normpath(full))
        if lexical != base and base not in lexical.parents:
            return [("output_dir", f"{output_dir!r} leaves the working directory {base} (it resolves to "
                                   f"{lexical}); write an absolute path to put the run there on purpose")]
    return []


def cross_check(r) -> list[tuple[str, str]]:
    """Every cross-field problem of a parsed recipe, as ``(key path, text)`` pairs."""
    out: list[tuple[str, str]] = []
    s, t, d, tr = r.speculator, r.target, r.data, r.training

    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", t.device):
        out.append(("target.device", f"{t.device!r} is not auto, cpu, mps, cuda or cuda:N"))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", r.name):
        out.append(("name", f"{r.name!r} may hold only letters, digits, '.', '_' and '-' (it names directories)"))

    # feature layers: which the method reads
    fl = t.feature_layers
    if fl is not None:
        if r.method == "draft":
            out.append(("target.feature_layers", "draft models read tokens, not target features: leave it unset"))
        elif not fl:
            out.append(("target.feature_layers", "must not be empty (null = the method's default)"))
        elif any(i < 0 for i in fl):
            out.append(("target.feature_layers", f"indices must be >= 0, got {fl}"))
        elif len(set(fl)) != len(fl):
            out.append(("target.feature_layers", f"indices must be distinct, got {fl}"))
        elif r.method in ("eagle", "medusa1", "medusa2") and len(fl) != 1:
            out.append(("target.feature_layers",
                        f"{r.method} reads exactly one feature (the final normed state, index L), got {fl}"))

    # method-specific speculator checks
    if r.method == "medusa2" and s.lora is None:
        out.append(("speculator.lora", "medusa2 trains the backbone jointly through LoRA: set speculator.lora "
                                       "(e.g. {r: 16, alpha: 32}); use medusa1 for frozen-backbone heads"))
    if r.method in ("medusa1", "medusa2") and s.choices == "fit":
        if r.method != "medusa1":
            out.append(("speculator.choices", "'fit' measures the heads on the frozen target's held-out features: "
                                              "medusa1 only (medusa2 trains the backbone); give the paths instead"))
        elif not r.training.eval_every:
            out.append(("speculator.choices", "'fit' needs held-out sequences: set training.eval_every > 0 "
                                              "(they are split off for the mid-run evaluation)"))
    elif r.method in ("medusa1", "medusa2") and s.choices is not None:
        from specfoundry.runtime.adaptive import MAX_DRAFT_NODES
        from specfoundry.runtime.speculators.checkpoint import choices_problem

        problem = choices_problem(s.choices, MAX_DRAFT_NODES - 1, s.num_heads)
        if problem:
            out.append(("speculator.choices", problem))
    if r.method == "medusa2" and s.lora is not None and not s.lora.target_modules:
        out.append(("speculator.lora.target_modules", "must name at least one module"))
    if r.method == "draft":
        given = [k for k in ("layers", "config", "init_from") if getattr(s, k) is not None]
        if len(given) != 1:
            out.append(("speculator", "a draft needs exactly one of layers (a subset of target layers), config "
                                      f"(a fresh architecture) or init_from (a pretrained model); got "
                                      f"{', '.join(given) if given else 'none'}"))
        if s.layers is not None and (s.layers != sorted(set(s.layers)) or not s.layers or min(s.layers) < 0):
            out.append(("speculator.layers", f"must be non-empty, ascending, distinct and >= 0, got {s.layers}"))
        c = s.config
        if c is not None:
            kv = c.num_key_value_heads or c.num_attention_heads
            if c.num_attention_heads % kv:
                out.append(("speculator.config.num_key_value_heads",
                            f"{kv} does not divide num_attention_heads {c.num_attention_heads}"))
            if c.head_dim is None and c.hidden_size % c.num_attention_heads:
                out.append(("speculator.config.hidden_size",
                            f"{c.hidden_size} is not divisible by num_attention_heads {c.num_attention_heads} "
                            "(or set head_dim)"))

    # data
    if not d.prompts:
        out.append(("data.prompts", "needs at least one prompt source"))
    known = _known_prompt_count(d)
    if known is not None and d.eval_prompts >= known:
        out.append(("data.eval_prompts", f"holds out {d.eval_prompts} of only {known} prompts: nothing left to train on"))
    if r.method == "medusa2" and d.hidden_states == "offline":
        out.append(("data.hidden_states", "medusa2 trains the backbone, so precomputed (offline) hidden states "
                                          "go stale after the first step: use online"))
    if r.method == "draft" and d.hidden_states == "offline":
        out.append(("data.hidden_states", "draft distillation needs the target's full-vocabulary logits per token; "
                                          "storing them offline is impractical: use online"))
    if d.responses.sampled_fraction and d.responses.temperature:
        out.append(("data.responses.sampled_fraction",
                    f"temperature {d.responses.temperature} already samples every answer: set temperature 0 (greedy) "
                    "for the rest of the mix, or sampled_fraction 0"))
    for i, src in enumerate(d.prompts):
        if src.source == "magpie" and src.max_prompt_tokens >= d.max_seq_len:
            out.append((f"data.prompts[{i}].max_prompt_tokens",
                        f"{src.max_prompt_tokens} leaves no room for a response in max_seq_len {d.max_seq_len}"))

    # training
    if tr.max_steps is None and tr.epochs is None:
        out.append(("training", "set max_steps or epochs (max_minutes alone would make the schedule undefined)"))
    if tr.ttt_steps is not None and r.method != "eagle3":
        out.append(("training.ttt_steps", f"training-time-test unrolling is EAGLE-3 only; remove it for {r.method}"))

    # launcher
    out += launcher_problems(r)
    out += output_dir_problems(r.output_dir)

    # evaluation
    ev = r.evaluation
    if not ev.prompt_sets:
        out.append(("evaluation.prompt_sets", "needs at least one set (builtin-heldout or a JSON/JSONL file)"))
    for i, ps in enumerate(ev.prompt_sets):
        if ps == BUILTIN_HELDOUT:
            if d.eval_prompts == 0:
                out.append((f"evaluation.prompt_sets[{i}]", "builtin-heldout needs data.eval_prompts > 0"))
        elif not ps.endswith((".json", ".jsonl")):
            out.append((f"evaluation.prompt_sets[{i}]", f"{ps!r} is neither {BUILTIN_HELDOUT!r} nor a .json/.jsonl file"
                        + suggest(ps, [BUILTIN_HELDOUT])))
    if not ev.temperatures:
        out.append(("evaluation.temperatures", "needs at least one temperature"))
    if any(x < 0 for x in ev.temperatures):
        out.append(("evaluation.temperatures", f"must be >= 0, got {ev.temperatures}"))
    return out


def _known_prompt_count(d) -> int | None:
    """Prompt count when every source states it (magpie count, file/hub limit), else None."""
    total = 0
    for src in d.prompts:
        n = src.count if src.source == "magpie" else src.limit
        if n is None:
            return None
        total += n
    return total
