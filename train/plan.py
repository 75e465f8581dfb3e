"""The training plan a ``--dry-run`` prints: sizes, memory per device, tokens, steps, time.

Scope: pure functions of a validated :class:`~specfoundry.train.recipe.Recipe` and the target's
:class:`~specfoundry.train.presets.Architecture` (a preset or a local ``config.json``): no model
is built or downloaded and torch is not imported. :func:`make_plan` computes (parameter counts and
memory per device come from :mod:`.plan_memory`), :func:`format_plan` renders.

Everything here is an estimate, and the assumptions are named where they are made:

- Parameters are counted from the architecture (Llama-style layers; exact for the presets).
- Memory per device follows the ZeRO paper's accounting (Rajbhandari et al. 2020) for Adam:
  mixed precision under DeepSpeed keeps 2 B weights + 2 B gradients + 12 B optimizer states
  (fp32 master, m, v) per trainable parameter; stage 1 partitions the optimizer states, stage 2
  also the gradients, stage 3 also the weights, each over the data-parallel processes. Without
  DeepSpeed (accelerate autocast) weights, gradients and both moments are fp32: 4 + 4 + 8 B.
  The frozen target is counted apart: whole per process (replicate), or under ZeRO-3 (placement
  zero3, train/zero3_target.py) 1/N of every parameter but the LM head plus whole copies of the
  LM head and embedding, with two gathered layers (or the embedding) as the gather working set;
  or spread over a machine's GPUs (device_map). Activations assume SDPA /
  flash attention (no seq^2 term) and a micro-batch of ``batch_size x max_seq_len`` tokens.
- Token counts assume the averages in ``_ASSUMED`` where the recipe gives only caps.
- Wall time is given only where a throughput was measured (``_MEASURED``, from DESIGN.md);
  otherwise only the recipe's ``max_minutes`` caps are shown.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .launcher import zero3_placement_problem
from .plan_memory import (BYTES, GB, Memory, SpeculatorSize, architecture_problems, memory_per_device,
                          speculator_size)
from .presets import Architecture, PresetError, resolve_architecture
from .recipe import (BUILTIN_HELDOUT, FilePrompts, MagpiePrompts, Recipe, RecipeError, read_accelerate_config,
                     read_deepspeed_config, resolve)

__all__ = ["Plan", "Memory", "SpeculatorSize", "make_plan", "format_plan", "speculator_size", "architecture_problems"]


# Averages used where a recipe only states caps. Magpie prompts usually stop well before the cap;
# greedy self-distilled answers of instruct models often run close to a small max_new_tokens.
_ASSUMED = {
    "magpie_prompt_fraction": 0.6,  # of max_prompt_tokens
    "file_prompt_tokens": 128,  # first user turns of ShareGPT/UltraChat-style data
    "response_fraction": 0.75,  # of max_new_tokens (measured 0.73: SmolLM2 self-distillation, max 192)
}

# Measured throughputs (DESIGN.md, "Measured here": 2-core dev machine, SmolLM2-135M).
# generate: batched bf16 greedy generation on the engine, Magpie prompts + responses together
# ~540 tok/s (2026-12-01, idle: 175 k tokens in 320 s; fp32 about half); capture: one forward per
# sequence ~900 tok/s, length-sorted batches of 8 ~2160 tok/s; decode_step_s: one batch-1 decode
# step on the engine, bf16 (12.5 ms idle, ~25 ms on a shared CPU: the evaluation's four cells of 8
# prompts took ~1.5 min); train eagle3: bf16 autocast, 2048-token draft vocabulary, 3 TTT
# steps ~2,300-2,500 tok/s (docs/results.md, default recipe). engine: the target decodes on the
# runtime's engine, so a batched offline capture reads the states its generation kept.
_MEASURED: dict[tuple[str, str], dict] = {
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "cpu"): {
        "engine": True,
        "generate_tok_s": {"bf16": 540.0, "fp16": 540.0, "fp32": 270.0},
        "capture_tok_s": 900.0,
        "capture_batched_tok_s": 2160.0,
        "decode_step_s": 0.025,
        "train_tok_s": {"eagle3": 2400.0},
    },
}



@dataclass
class Plan:
    recipe: Recipe  # resolved
    target: Architecture
    speculator: SpeculatorSize
    device: str  # cpu | cuda | mps
    world_size: int
    num_machines: int
    zero_stage: int
    placement: str
    target_params: int
    target_weight_bytes: float  # whole target in its dtype (all devices together)
    memory: Memory  # the recipe's own stage
    memory_by_stage: dict[int, Memory]  # what-if: no ZeRO / ZeRO-2 / ZeRO-3 (multi-process only)
    device_memory: float | None
    fits: bool | None
    # data
    prompts: int | None
    prompt_sources: list[str]
    train_prompts: int | None
    eval_prompts: int
    prompt_tokens: float  # average per prompt
    response_tokens: float  # average per response
    seq_tokens: float  # average per training sequence (capped at max_seq_len)
    total_tokens: float | None  # train sequences x seq_tokens
    loss_tokens: float | None
    generated_tokens: float | None  # tokens the target writes (magpie prompts + responses)
    # schedule
    global_batch: int
    steps_per_epoch: int | None
    steps: int | None
    epochs: float | None
    # time (seconds; None = no measured throughput)
    data_s: float | None  # generation (what data.max_minutes caps)
    capture_s: float | None  # offline hidden-state capture after it (no budget of its own)
    train_s: float | None
    eval_s: float | None
    budget_s: dict[str, float | None]  # the recipe's max_minutes caps per stage
    shape_s: float | None = None  # the runtime-shape timing after the evaluation (EAGLE heads)
    warnings: list[str] = field(default_factory=list)

    @property
    def trainable_params(self) -> int:
        return self.speculator.trainable


# --------------------------------------------------------------------------------------------
# data and schedule
# --------------------------------------------------------------------------------------------

def _count_file_records(path: str) -> int | None:
    """Records in a local JSON/JSONL file, or None when it is not here (never fatal)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return None
    try:
        if p.suffix == ".jsonl":
            # split on \n only: some prompt files hold U+2028 inside strings
            return sum(1 for line in p.read_text(encoding="utf-8").split("\n") if line.strip())
        data = json.loads(p.read_text(encoding="utf-8"))
        return len(data) if isinstance(data, list) else None
    except (OSError, ValueError):
        return None


def _prompt_stats(r: Recipe) -> tuple[int | None, float, list[str]]:
    total: int | None = 0
    weighted, described = 0.0, []
    for src in r.data.prompts:
        if isinstance(src, MagpiePrompts):
            n, avg = src.count, _ASSUMED["magpie_prompt_fraction"] * src.max_prompt_tokens
            described.append(f"{n} magpie")
        elif isinstance(src, FilePrompts):
            found = _count_file_records(src.path)
            n = min(x for x in (src.limit, found) if x is not None) if (src.limit or found) else None
            avg = _ASSUMED["file_prompt_tokens"]
            described.append(f"{n if n is not None else '?'} file:{src.path}")
        else:
            n, avg = src.limit, _ASSUMED["file_prompt_tokens"]
            described.append(f"{n if n is not None else 'all'} hub:{src.name}[{src.split}]")
        if n is None or total is None:
            total = None
            weighted += avg
        else:
            total += n
            weighted += n * avg
    if total:
        avg_prompt = weighted / total
    else:
        avg_prompt = weighted / max(len(r.data.prompts), 1)
    return total, avg_prompt, described


# --------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------

def _placement(r: Recipe, stage: int, world: int) -> str:
    """Where the frozen target lives for ZeRO stage ``stage`` over ``world`` processes: partitioned
    (``zero3``, what train/zero3_target.py does) only under stage 3 with several processes; ``auto``
    also only where the recipe allows it (:func:`~specfoundry.train.launcher.zero3_placement_problem`)."""
    want = r.target.placement
    if want == "zero3":
        return "zero3" if stage == 3 and world > 1 else "replicate"
    if want == "auto":
        return "zero3" if stage == 3 and world > 1 and zero3_placement_problem(r) is None else "replicate"
    return want


def make_plan(recipe: Recipe, *, zero_stage: int | None = None, arch: Architecture | None = None) -> Plan:
    """The plan for ``recipe`` (no download). ``zero_stage`` overrides the launcher's stage for a
    what-if comparison; ``arch`` overrides the target architecture lookup. Raises
    :class:`RecipeError` when the recipe does not fit the target's shape."""
    r = resolve(recipe)
    try:
        A = arch or resolve_architecture(r.target.name)
    except PresetError as e:
        raise RecipeError(recipe.source or r.name, [("target.name", str(e))]) from None
    problems = architecture_problems(r, A)
    if problems:
        raise RecipeError(recipe.source or r.name, problems)
    acc = read_accelerate_config(r.launcher.config)
    device = "cpu" if r.target.device == "cpu" or acc.get("use_cpu") else ("mps" if r.target.device == "mps" else "cuda")
    world, machines = int(r.launcher.num_processes), int(r.launcher.num_machines)
    ds = read_deepspeed_config(r.launcher.deepspeed) if r.launcher.deepspeed else None
    own_stage = int(ds.get("zero_optimization", {}).get("stage", 0)) if ds else 0
    stage = own_stage if zero_stage is None else int(zero_stage)
    if zero_stage is not None and zero_stage != own_stage:
        ds = {"zero_optimization": {"stage": stage}} if stage > 0 else None  # plain stage, no offload
    spec = speculator_size(r, A)
    placement = _placement(r, stage, world)
    warnings: list[str] = []

    memory = memory_per_device(r, A, spec, stage, world, placement, device, ds)
    by_stage: dict[int, Memory] = {}
    if world > 1:
        for st in (0, 2, 3):
            sds = ds if st == stage else ({"zero_optimization": {"stage": st}} if st else None)
            by_stage[st] = memory_per_device(r, A, spec, st, world, _placement(r, st, world), device, sds)
    cap = r.launcher.device_memory_gb * GB if r.launcher.device_memory_gb else None
    fits = None if cap is None else memory.total <= cap
    if fits is False:
        warnings.append(f"estimated {memory.total / GB:.1f} GB per device exceeds the {cap / GB:.0f} GB device")

    # data
    n_prompts, avg_prompt, described = _prompt_stats(r)
    d = r.data
    avg_resp = _ASSUMED["response_fraction"] * d.responses.max_new_tokens
    seq = min(float(d.max_seq_len), avg_prompt + avg_resp)
    if avg_prompt + avg_resp > d.max_seq_len:
        warnings.append(f"prompt ~{avg_prompt:.0f} + response ~{avg_resp:.0f} tokens exceed max_seq_len "
                        f"{d.max_seq_len}: sequences get truncated")
    n_train = None if n_prompts is None else n_prompts - d.eval_prompts
    if n_train is not None and n_train <= 0:
        warnings.append(f"only {n_prompts} prompts for {d.eval_prompts} held out: nothing to train on")
        n_train = 0
    loss_per_seq = seq if d.loss_on_prompt else min(avg_resp, seq)
    total_tokens = None if n_train is None else n_train * seq
    loss_tokens = None if n_train is None else n_train * loss_per_seq
    magpie_tokens = sum(s.count * _ASSUMED["magpie_prompt_fraction"] * s.max_prompt_tokens
                        for s in d.prompts if isinstance(s, MagpiePrompts))
    generated = None if n_prompts is None else magpie_tokens + n_prompts * avg_resp

    # schedule: every process is a data-parallel replica
    tr = r.training
    gbatch = tr.batch_size * tr.grad_accum * world
    per_epoch = None if not n_train else math.ceil(n_train / gbatch)
    candidates = [tr.max_steps] if tr.max_steps else []
    if tr.epochs is not None and n_train:
        candidates.append(max(1, math.ceil(tr.epochs * n_train / gbatch)))
    steps = min(candidates) if candidates else None
    epochs = None if not (steps and n_train) else steps * gbatch / n_train
    if steps is not None and tr.warmup_steps >= steps:
        warnings.append(f"warmup_steps {tr.warmup_steps} >= {steps} steps: the learning rate never reaches its peak")
    if steps is None:
        warnings.append("steps unknown: the prompt count is not stated (hub source without limit); set max_steps "
                        "or a limit")

    # time, where measured
    m = _MEASURED.get((A.name, device), {})
    data_s = capture_s = train_s = eval_s = None
    gen_rate = m.get("generate_tok_s", {}).get(d.responses.dtype or r.target.dtype)
    if gen_rate and generated is not None:
        data_s = generated / gen_rate
    cap_rate = m.get("capture_batched_tok_s" if d.capture_batch_size > 1 else "capture_tok_s")
    if d.hidden_states == "offline" and cap_rate and n_train:
        capture_s = n_train * seq / cap_rate
        if m.get("engine") and d.capture_batch_size > 1 and (d.responses.dtype or r.target.dtype) == r.target.dtype:
            capture_s = 0.0  # the engine's store reads the states the self-distillation computed (train/genstates.py)
    train_rate = m.get("train_tok_s", {}).get(r.method)
    if train_rate and steps:
        train_s = steps * gbatch * seq / train_rate
    ev = r.evaluation
    if m.get("decode_step_s"):
        n_eval = sum(min(ev.limit, d.eval_prompts) if ps == BUILTIN_HELDOUT else ev.limit for ps in ev.prompt_sets)
        # speculative decoding roughly breaks even on this CPU, so each decode costs ~ a plain one
        eval_s = n_eval * len(ev.temperatures) * ev.max_new_tokens * m["decode_step_s"] * (2 if ev.baseline else 1)
    budget = {"data": d.max_minutes and d.max_minutes * 60, "training": tr.max_minutes and tr.max_minutes * 60,
              "evaluation": ev.max_minutes and ev.max_minutes * 60}
    shape_s = None
    if r.method in ("eagle3", "eagle") and ev.runtime_prompts and ev.runtime_shapes:
        # plain decoding and every candidate per held-out prompt (runtime/tune.py); the candidates
        # ran ~1.1-1.3x plain decoding with the default head (docs/results.md)
        budget["runtime shape"] = ev.runtime_max_minutes and ev.runtime_max_minutes * 60
        if m.get("decode_step_s"):
            # (the draft temperature after it, one plain decode per prompt and temperature, is not under this
            # stage's budget and not counted here: 10 s on the default recipe, runtime/calibrate.py)
            shape_s = (min(ev.runtime_prompts, d.eval_prompts) * (1 + len(ev.runtime_shapes) / 1.2) * ev.max_new_tokens
                       * m["decode_step_s"])
    for stage_name, est in (("data", data_s), ("training", train_s), ("evaluation", eval_s),
                            ("runtime shape", shape_s)):
        if stage_name not in budget:
            continue
        cap_s = budget[stage_name]
        if est is not None and cap_s is not None and est > cap_s:
            warnings.append(f"{stage_name} estimated {est / 60:.1f} min is cut at its {cap_s / 60:g} min budget")

    return Plan(recipe=r, target=A, speculator=spec, device=device, world_size=world, num_machines=machines,
                zero_stage=stage, placement=placement, target_params=A.param_count(),
                target_weight_bytes=A.param_count() * BYTES[r.target.dtype], memory=memory,
                memory_by_stage=by_stage, device_memory=cap, fits=fits, prompts=n_prompts, prompt_sources=described,
                train_prompts=n_train, eval_prompts=d.eval_prompts, prompt_tokens=avg_prompt, response_tokens=avg_resp,
                seq_tokens=seq, total_tokens=total_tokens, loss_tokens=loss_tokens, generated_tokens=generated,
                global_batch=gbatch, steps_per_epoch=per_epoch, steps=steps, epochs=epochs, data_s=data_s, capture_s=capture_s,
                train_s=train_s, eval_s=eval_s, budget_s=budget, shape_s=shape_s, warnings=warnings)


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------

def _n(x: float | None) -> str:
    if x is None:
        return "?"
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f}"


def _gb(x: float) -> str:
    return f"{x / GB:8.2f} GB"


def _min(s: float | None) -> str:
    return "?" if s is None else f"{s / 60:.1f} min"


def _stage_name(st: int) -> str:
    return "no ZeRO" if st == 0 else f"ZeRO-{st}"


def format_plan(plan: Plan) -> str:
    """Human-readable plan (what ``specfoundry train <recipe> --dry-run`` prints)."""
    r, A, m = plan.recipe, plan.target, plan.memory
    ln = r.launcher
    out = [f"plan for recipe {r.name} ({r.method}){': ' + r.description if r.description else ''}"]
    out.append(f"  target      {A.name}: {_n(plan.target_params)} params ({A.num_layers} layers, hidden "
               f"{A.hidden_size}, {A.num_attention_heads}/{A.num_key_value_heads} heads, vocab {A.vocab_size}); "
               f"{r.target.dtype} weights {plan.target_weight_bytes / GB:.1f} GB")
    if r.method != "draft":
        out.append(f"  features    target hidden_states {r.target.feature_layers}")
    out.append(f"  speculator  {plan.speculator.description}: {_n(plan.speculator.total)} params, "
               f"{_n(plan.speculator.trainable)} trainable")
    launch = ln.config + (f" + DeepSpeed {ln.deepspeed}" if ln.deepspeed else "")
    out.append(f"  launcher    {launch}: {plan.world_size} process(es) on {plan.num_machines} machine(s), "
               f"{plan.device}, {_stage_name(plan.zero_stage)}, target placement {plan.placement}, "
               f"precision {r.training.precision}")
    where = "host RAM per process" if plan.device == "cpu" else "memory per device"
    out.append(f"{where} (estimate, {_stage_name(plan.zero_stage)}, {plan.world_size} process(es)):")
    for label, v in (("frozen target weights", m.target_weights), ("trainable weights", m.trainable_weights),
                     ("gradients", m.gradients), ("optimizer states (AdamW)", m.optimizer_states),
                     ("activations", m.activations), ("ZeRO-3 gather buffers", m.gather_buffers),
                     ("runtime overhead", m.overhead)):
        if v or label in ("frozen target weights", "activations"):
            out.append(f"  {label:<26}{_gb(v)}")
    total = f"  {'total':<26}{_gb(m.total)}"
    if plan.device_memory:
        total += f"  of {plan.device_memory / GB:.0f} GB: {'fits' if plan.fits else 'DOES NOT FIT'}"
    out.append(total)
    if m.offloaded:
        out.append(f"  {'offloaded to host':<26}{_gb(m.offloaded)}")
    for note in m.notes:
        out.append(f"  - {note}")
    if plan.memory_by_stage:
        out.append("  by ZeRO stage: " + " | ".join(f"{_stage_name(s)} {mm.total / GB:.1f} GB"
                                                  for s, mm in sorted(plan.memory_by_stage.items())))
    d = r.data
    out.append("data:")
    out.append(f"  prompts     {plan.prompts if plan.prompts is not None else '?'} "
               f"({', '.join(plan.prompt_sources)}); {plan.eval_prompts} held out; "
               f"{plan.train_prompts if plan.train_prompts is not None else '?'} train")
    out.append(f"  tokens      ~{plan.prompt_tokens:.0f} prompt + ~{plan.response_tokens:.0f} response per sequence "
               f"(max_seq_len {d.max_seq_len}) -> ~{_n(plan.total_tokens)} training tokens, ~{_n(plan.loss_tokens)} "
               f"with loss; target writes ~{_n(plan.generated_tokens)} tokens; hidden states {d.hidden_states}")
    tr = r.training
    out.append("schedule:")
    out.append(f"  global batch {plan.global_batch} = {tr.batch_size} x {tr.grad_accum} grad_accum x "
               f"{plan.world_size} process(es); {plan.steps_per_epoch or '?'} steps/epoch; "
               f"{plan.steps or '?'} steps"
               + (f" (~{plan.epochs:.2f} epochs)" if plan.epochs else "")
               + f"; lr {tr.learning_rate:g} {tr.scheduler}, warmup {tr.warmup_steps}")
    if all(x is None for x in (plan.data_s, plan.train_s, plan.eval_s, *plan.budget_s.values())):
        out.append("time: no measured throughput for this target and device, and no max_minutes budgets")
    else:
        out.append("time (estimate where measured; capped by max_minutes):")
        total_est, total_cap, known = 0.0, 0.0, True
        for name, est in (("data", plan.data_s), ("capture", plan.capture_s), ("training", plan.train_s),
                          ("evaluation", plan.eval_s), ("runtime shape", plan.shape_s)):
            if (name == "capture" and est is None) or (name == "runtime shape" and name not in plan.budget_s):
                continue
            cap = plan.budget_s.get(name)
            shown = est if cap is None or est is None else min(est, cap)
            if name == "capture" and shown == 0.0:
                out.append(f"  {name:<13} none: self-distillation keeps the states of what it generates")
                continue
            out.append(f"  {name:<13} {_min(shown) if shown is not None else 'no measured throughput'}"
                       + (f" (budget {cap / 60:g} min)" if cap is not None else ""))
            known &= shown is not None
            total_est += shown or 0.0
            total_cap += cap if cap is not None else (est if name == "capture" else float("inf"))
        if known:
            out.append(f"  total         ~{total_est / 60:.1f} min")
        if math.isfinite(total_cap):
            out.append(f"  at most       {total_cap / 60:.0f} min of stage budgets and capture (plus model loading)")
    if plan.warnings:
        out.append("warnings:")
        out += [f"  - {w}" for w in plan.warnings]
    return "\n".join(out)
