"""Training recipes: a strict schema, loading, resolving and dumping.

Scope: the recipe dataclasses (one per YAML section, every field documented beside it), the
strict parser that turns YAML into them, cross-field validation, default filling
(:func:`resolve`), ``recipe.resolved.yaml`` output, and locating the packaged recipes and
launcher configs (``recipes/*.yaml``, ``recipes/accelerate/*.yaml``,
``recipes/deepspeed/*.json``). It does not build models, read data or launch anything; the
only files it reads besides the recipe are the accelerate/DeepSpeed launcher configs (for
cross-field checks). No torch import: ``--dry-run`` and the tests stay fast.

Strictness: unknown keys, wrong types, out-of-range values and bad combinations are all
errors, collected and raised together as one :class:`RecipeError` whose message names the
file, the key path (``data.prompts[0].count``) and, for a typo, the closest valid key.
Duplicate YAML keys are errors too (PyYAML would silently keep the last one).

Relative paths inside a recipe (prompt files, evaluation sets, ``output_dir``) are kept as
written and resolve against the working directory of the run (the repository root under
``make``), not against the recipe file.

Launching: ``accelerate launch <launch_args(recipe)> -m specfoundry.train <recipe>``. The
DeepSpeed JSON is passed with ``--deepspeed_config_file`` (absolute), which overrides the
relative path written in the accelerate YAML, so installed packages work from any directory.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, Union

import yaml

__all__ = [
    "RecipeError", "Recipe", "TargetConfig", "Eagle3Speculator", "EagleSpeculator", "MedusaSpeculator",
    "Medusa2Speculator", "DraftSpeculator", "DraftArchConfig", "LoraConfig", "MagpiePrompts", "FilePrompts",
    "HubPrompts", "ResponsesConfig", "DataConfig", "TrainingConfig", "LauncherConfig", "TrackingConfig",
    "EvaluationConfig", "METHODS", "load_recipe", "recipe_from_dict", "resolve", "dump_resolved", "list_recipes",
    "recipe_path", "prompt_source_dicts", "accelerate_config_path", "deepspeed_config_path", "list_launcher_configs", "read_accelerate_config",
    "read_deepspeed_config", "zero_stage", "launch_args", "deepspeed_config_for", "default_feature_layers",
]

Method = Literal["eagle3", "eagle", "medusa1", "medusa2", "draft"]
METHODS: tuple[str, ...] = typing.get_args(Method)
Precision = Literal["fp32", "bf16", "fp16"]
# accepted spellings -> canonical (torch names are what people type from habit)
_PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
BUILTIN_HELDOUT = "builtin-heldout"
RESOLVED_FILENAME = "recipe.resolved.yaml"


class RecipeError(ValueError):
    """Every problem found in one recipe, in one message. ``problems`` holds ``(key path, text)``."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = list(problems)
        if len(problems) == 1:
            msg = f"invalid recipe {source}: {_fmt_problem(*problems[0])}"
        else:
            lines = "\n".join(f"  - {_fmt_problem(p, t)}" for p, t in problems)
            msg = f"invalid recipe {source}: {len(problems)} problems\n{lines}"
        super().__init__(msg)


def _fmt_problem(path: str, text: str) -> str:
    # unknown-key messages already name their section; the rest lead with the key path
    return text if not path or text.startswith("unknown key") else f"{path}: {text}"


def _f(default: Any = dataclasses.MISSING, **checks) -> Any:
    """A dataclass field with range checks in its metadata (``ge``, ``gt``, ``le``, ``lt``).
    Lists and dicts become default factories so instances never share them."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        proto = default
        return field(default_factory=lambda: copy.deepcopy(proto), metadata=checks)
    return field(default=default, metadata=checks)


# --------------------------------------------------------------------------------------------
# schema
# --------------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class TargetConfig:
    # built-in name ("smollm2-135m"), a local HF directory, or a hub id (presets cover the dry run)
    name: str = "smollm2-135m"
    # dtype the frozen target runs in for data generation, hidden-state capture and evaluation;
    # labels should come from the dtype you serve in (bf16 and fp32 argmax differ on ~2%)
    dtype: Precision = "bf16"
    # target hidden_states indices fed to the speculator; None = the method's default
    # (eagle3: 2, L//2, L-3; eagle/medusa: L, the final normed state); unused by draft
    feature_layers: list[int] | None = None
    # auto | cpu | mps | cuda | cuda:N ; auto follows the launcher (use_cpu -> cpu, else cuda)
    device: str = "auto"
    # how the frozen target is placed for online hidden states when several processes train:
    # replicate (full copy per process), zero3 (partitioned with the head by DeepSpeed ZeRO-3,
    # gathered layer by layer in the forward), device_map (one process, layers spread over the
    # visible GPUs). auto: zero3 under a ZeRO-3 launcher, else replicate
    placement: Literal["auto", "replicate", "zero3", "device_map"] = "auto"


@dataclass(kw_only=True)
class Eagle3Speculator:
    # reduced draft vocabulary (most frequent target tokens in the training responses; d2t/t2d maps)
    draft_vocab_size: int = _f(32000, ge=1)
    # decoder layers in the head (EAGLE-3 uses 1; the first reads cat(embed, fused feature), 2H wide)
    num_layers: int = _f(1, ge=1)
    # copy this target layer's weights into the head's layer (None: random init); the wider
    # first-layer q/k/v inputs get the copied weights on the feature half
    init_from_target_layer: int | None = _f(None, ge=0)


@dataclass(kw_only=True)
class EagleSpeculator:
    # decoder layers in the head (EAGLE-1 uses 1)
    num_layers: int = _f(1, ge=1)
    # copy this target layer's weights into the head's layer (None: random init)
    init_from_target_layer: int | None = _f(None, ge=0)
    # weight of the smooth-L1 regression onto the next target feature (EAGLE's w_reg)
    feature_loss_weight: float = _f(1.0, ge=0)
    # weight of the token cross-entropy through the target's LM head (EAGLE's w_cls)
    token_loss_weight: float = _f(0.1, ge=0)


@dataclass(kw_only=True)
class MedusaSpeculator:
    # K heads; head k predicts the token k+1 steps after the target's own next token
    num_heads: int = _f(4, ge=1)
    # residual blocks per head
    num_layers: int = _f(1, ge=1)
    # static tree as paths of per-head ranks, e.g. [[0], [0, 0], [1]]; must be prefix-closed.
    # None = the runtime's default tree (runtime.speculators.medusa.default_medusa_choices)
    choices: list[list[int]] | None = None


@dataclass(kw_only=True)
class LoraConfig:
    # LoRA rank
    r: int = _f(16, ge=1)
    # LoRA scaling numerator (scale = alpha / r)
    alpha: int = _f(32, ge=1)
    # dropout on the LoRA input
    dropout: float = _f(0.05, ge=0, lt=1)
    # target module names inside each decoder layer (peft's target_modules)
    target_modules: list[str] = _f(["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass(kw_only=True)
class Medusa2Speculator(MedusaSpeculator):
    # LoRA on the backbone (required for medusa2: the backbone trains jointly with the heads)
    lora: LoraConfig | None = None
    # merge the LoRA weights into the saved backbone (else save the adapter beside the heads)
    merge: bool = False
    # lambda_0 of the Medusa-2 joint loss: L_lm + heads_loss_weight * sum_k w^k L_k
    heads_loss_weight: float = _f(0.2, ge=0)
    # steps that train the heads alone before the backbone LoRA joins (Medusa-2's warm-up)
    heads_warmup_steps: int = _f(0, ge=0)


@dataclass(kw_only=True)
class DraftArchConfig:
    # hidden width of the draft
    hidden_size: int = _f(ge=1)
    # decoder layers of the draft
    num_layers: int = _f(ge=1)
    # attention heads
    num_attention_heads: int = _f(ge=1)
    # KV heads (None: = num_attention_heads)
    num_key_value_heads: int | None = _f(None, ge=1)
    # MLP width (None: 8/3 * hidden_size rounded up to a multiple of 64, Llama's rule)
    intermediate_size: int | None = _f(None, ge=1)
    # per-head dim (None: hidden_size // num_attention_heads)
    head_dim: int | None = _f(None, ge=1)


@dataclass(kw_only=True)
class DraftSpeculator:
    # initialise from these target layers (ascending, distinct), plus the target's embedding,
    # final norm and LM head; exactly one of layers / config / init_from
    layers: list[int] | None = None
    # or a fresh Llama-style model of this shape (vocabulary = the target's)
    config: DraftArchConfig | None = None
    # or a pretrained model sharing the target's tokenizer (preset name, local dir or hub id)
    init_from: str | None = None
    # distillation loss on the target's logits: forward KL(p_target || q_draft) or total variation
    # (TV bounds the acceptance rate directly: accept = 1 - TV)
    kd_loss: Literal["forward_kl", "tv"] = "forward_kl"
    # softmax temperature applied to both logits inside the KD loss
    temperature: float = _f(1.0, gt=0)


SPECULATOR_CLASSES: dict[str, type] = {
    "eagle3": Eagle3Speculator, "eagle": EagleSpeculator, "medusa1": MedusaSpeculator,
    "medusa2": Medusa2Speculator, "draft": DraftSpeculator,
}
SpeculatorConfig = Union[Eagle3Speculator, EagleSpeculator, MedusaSpeculator, Medusa2Speculator, DraftSpeculator]


@dataclass(kw_only=True)
class MagpiePrompts:
    source: Literal["magpie"] = "magpie"
    # prompts to synthesize with the target itself (Magpie: the chat template's user-turn prefix)
    count: int = _f(256, ge=1)
    # seed topics for diversity: "builtin" or a text file with one topic per line
    topics: str = "builtin"
    # sampling seed (prompt i uses seed + i, so counts can grow without reshuffling)
    seed: int = 0
    # cap on each synthesized prompt
    max_prompt_tokens: int = _f(64, ge=1)
    # sampling temperature / nucleus for the prompt writer (diversity matters more than quality)
    temperature: float = _f(1.0, gt=0)
    top_p: float = _f(0.95, gt=0, le=1)


@dataclass(kw_only=True)
class FilePrompts:
    source: Literal["file"] = "file"
    # local JSON/JSONL: ShareGPT `conversations`, Spec-Bench/MT-bench `turns`, `prompt`,
    # `question` or `instruction` records; the first user turn is the prompt
    path: str = _f()
    # first N usable records (None: all)
    limit: int | None = _f(None, ge=1)


@dataclass(kw_only=True)
class HubPrompts:
    source: Literal["hub"] = "hub"
    # datasets hub name (needs network or a populated HF datasets cache)
    name: str = _f()
    # dataset configuration (datasets' second argument, e.g. a language pair)
    subset: str | None = None
    split: str = "train"
    # first N usable records (None: all)
    limit: int | None = _f(None, ge=1)


PROMPT_SOURCES: dict[str, type] = {"magpie": MagpiePrompts, "file": FilePrompts, "hub": HubPrompts}
PromptSource = Union[MagpiePrompts, FilePrompts, HubPrompts]


@dataclass(kw_only=True)
class ResponsesConfig:
    # self-distilled response length cap (the target writes every training response)
    max_new_tokens: int = _f(256, ge=1)
    # 0 = greedy (labels equal the target's argmax); > 0 samples
    temperature: float = _f(0.0, ge=0)
    top_p: float = _f(1.0, gt=0, le=1)
    # prompts per batched generate call (left padding)
    batch_size: int = _f(32, ge=1)
    # dtype of the generating target (None: target.dtype)
    dtype: Precision | None = None


@dataclass(kw_only=True)
class DataConfig:
    # prompt sources, concatenated in order; each is {source: magpie|file|hub, ...}
    prompts: list[PromptSource] = _f([MagpiePrompts()])
    # response generation (self-distillation by the target)
    responses: ResponsesConfig = _f(ResponsesConfig())
    # prompt + response tokens per training sequence (longer ones are truncated)
    max_seq_len: int = _f(2048, ge=8)
    # prompts held out of training (the "builtin-heldout" evaluation set and eval loss)
    eval_prompts: int = _f(32, ge=0)
    # online: the frozen target runs inside each step; offline: features are precomputed to
    # sharded files once, then reused every epoch (same dataset interface for both)
    hidden_states: Literal["online", "offline"] = "online"
    # put loss on prompt positions too (more signal per sequence when data is scarce)
    loss_on_prompt: bool = False
    # where prompts, responses and feature shards are cached (None: $SPECFOUNDRY_CACHE/data/<name>)
    cache_dir: str | None = None
    # wall budget for data generation; stops early and trains on what exists (None: no cap)
    max_minutes: float | None = _f(None, gt=0)
    # offline capture: sequences per target forward (1: one unpadded forward each, bit-identical
    # to online; > 1: length-sorted padded batches, same values up to rounding, ~2x faster on CPU)
    capture_batch_size: int = _f(1, ge=1)


@dataclass(kw_only=True)
class TrainingConfig:
    # optimizer steps (None: from epochs); with both set, whichever ends first
    max_steps: int | None = _f(None, ge=1)
    # passes over the training sequences (may be fractional)
    epochs: float | None = _f(None, gt=0)
    # wall budget for the training loop; checkpoints and stops when reached (None: no cap)
    max_minutes: float | None = _f(None, gt=0)
    # sequences per micro-batch per process
    batch_size: int = _f(8, ge=1)
    # micro-batches per optimizer step
    grad_accum: int = _f(1, ge=1)
    # AdamW peak learning rate
    learning_rate: float = _f(1e-4, gt=0)
    weight_decay: float = _f(0.0, ge=0)
    warmup_steps: int = _f(0, ge=0)
    # decay after warm-up
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    seed: int = 0
    # EAGLE-3 training-time test: how many draft steps are unrolled on the head's own outputs
    # (None: 3 for eagle3; other methods must leave it unset)
    ttt_steps: int | None = _f(None, ge=1)
    # loss weight of draft position i is position_weight_decay ** i (EAGLE-3 unroll steps,
    # Medusa heads); 0.8 as in both papers
    position_weight_decay: float = _f(0.8, gt=0, le=1)
    # max gradient norm (None: no clipping)
    grad_clip: float | None = _f(0.5, gt=0)
    # recompute activations in the backward (for medusa2 / draft where the backbone trains)
    gradient_checkpointing: bool = False
    # save every N steps (0: only at the end and when max_minutes is reached)
    checkpoint_every: int = _f(0, ge=0)
    log_every: int = _f(10, ge=1)
    # evaluate the held-out loss / acceptance every N steps (0: only at the end)
    eval_every: int = _f(0, ge=0)
    # fp32, or bf16/fp16 mixed precision (fp16 needs CUDA)
    precision: Precision = "bf16"


@dataclass(kw_only=True)
class LauncherConfig:
    # accelerate config: a name in recipes/accelerate/ (single-cpu, single-gpu, ddp-2proc, ddp-gpu,
    # zero2, zero3, multinode-example) or a path to a YAML file
    config: str = "single-cpu"
    # DeepSpeed JSON: a name in recipes/deepspeed/ (zero2, zero3, zero3-offload) or a path;
    # required exactly when the accelerate config is a DeepSpeed one
    deepspeed: str | None = None
    # total processes over all machines (None: the accelerate config's num_processes)
    num_processes: int | None = _f(None, ge=1)
    # machines (None: the accelerate config's num_machines)
    num_machines: int | None = _f(None, ge=1)
    # memory of one device in GB, for the plan's fit check only (None: not checked)
    device_memory_gb: float | None = _f(None, gt=0)


@dataclass(kw_only=True)
class TrackingConfig:
    wandb_project: str = "specfoundry"
    wandb_entity: str | None = None
    # auto: online when WANDB_API_KEY is set, else offline; disabled: no tracker
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = "auto"
    # W&B run name (None: the recipe name)
    run_name: str | None = None
    # upload checkpoints as W&B artifacts
    log_model: bool = False


@dataclass(kw_only=True)
class EvaluationConfig:
    # "builtin-heldout" (data.eval_prompts held out of training) and/or JSON/JSONL prompt files,
    # e.g. ../shared/data/eval/mt_bench/question.jsonl
    prompt_sets: list[str] = _f([BUILTIN_HELDOUT])
    # prompts per set
    limit: int = _f(20, ge=1)
    max_new_tokens: int = _f(128, ge=1)
    # sampling temperatures to measure acceptance at (0.0 = greedy)
    temperatures: list[float] = _f([0.0, 1.0])
    # draft depth k (tokens proposed per step)
    depth: int = _f(5, ge=1)
    # EAGLE drafters: "dynamic" (EAGLE-2 tree) or "chain"; tree size including the root, and
    # children per expanded node (None: the drafter's defaults)
    tree: Literal["dynamic", "chain"] | None = None
    total_tokens: int | None = _f(None, ge=2)
    top_k: int | None = _f(None, ge=1)
    # let the runtime pick the depth per step from measured acceptance and costs; off gives the
    # fixed draft shape above, so tau measures the speculator rather than the controller
    adaptive: bool = True
    # also decode without speculation, for the speedup ratio
    baseline: bool = True
    # wall budget for evaluation (None: no cap)
    max_minutes: float | None = _f(None, gt=0)


@dataclass(kw_only=True)
class Recipe:
    # recipe name (empty: the file stem); names runs, caches and W&B
    name: str = ""
    # one line for humans (printed by the dry run)
    description: str = ""
    # eagle3 | eagle (EAGLE-1) | medusa1 | medusa2 | draft
    method: Method = _f()
    # where checkpoints and the resolved recipe go (None: runs/<name>)
    output_dir: str | None = None
    target: TargetConfig = _f(TargetConfig())
    # method-specific architecture options (None: the method's defaults)
    speculator: SpeculatorConfig | None = None
    data: DataConfig = _f(DataConfig())
    training: TrainingConfig = _f(TrainingConfig())
    launcher: LauncherConfig = _f(LauncherConfig())
    tracking: TrackingConfig = _f(TrackingConfig())
    evaluation: EvaluationConfig = _f(EvaluationConfig())
    # the file this recipe came from (not part of the schema)
    source: str | None = field(default=None, compare=False, metadata={"internal": True})

    def to_dict(self) -> dict:
        """Plain dict in schema order (what the YAML holds), without internal fields."""
        return _to_plain(self)


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``)."""


_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
_StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in list("-+0123456789."):
    _StrictLoader.yaml_implicit_resolvers[_ch] = [
        (t, r) for t, r in _StrictLoader.yaml_implicit_resolvers.get(_ch, []) if t != "tag:yaml.org,2002:float"]
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise _DuplicateKey(None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})",
                                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise RecipeError(source, [("", f"not valid YAML: {e}")]) from None


# --------------------------------------------------------------------------------------------
# strict parser
# --------------------------------------------------------------------------------------------

def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if origin is list:
        return "a list"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return str(tp)


def _got(value) -> str:
    if value is None:
        return "null"
    r = repr(value)
    return f"{type(value).__name__} {r if len(r) <= 40 else r[:37] + '...'}"


def _is_optional(tp) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, (args[0] if len(args) == 1 else Union[tuple(args)])
    return False, tp


def _suggest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


_SCHEMA_FIELDS_CACHE: dict[type, list[tuple[dataclasses.Field, Any]]] = {}


def _schema_fields(cls) -> list[tuple[dataclasses.Field, Any]]:
    if cls not in _SCHEMA_FIELDS_CACHE:
        hints = typing.get_type_hints(cls)
        _SCHEMA_FIELDS_CACHE[cls] = [(f, hints[f.name]) for f in dataclasses.fields(cls)
                                     if not f.metadata.get("internal")]
    return _SCHEMA_FIELDS_CACHE[cls]


class _Parser:
    def __init__(self):
        self.problems: list[tuple[str, str]] = []

    def err(self, path: str, text: str) -> None:
        self.problems.append((path, text))

    def value(self, tp, v, path: str, check: Mapping | None = None):
        """Parse ``v`` as ``tp``; returns ``(ok, value)`` and records problems."""
        optional, inner = _is_optional(tp)
        if v is None:
            if optional:
                return True, None
            self.err(path, f"expected {_type_name(inner)}, got null")
            return False, None
        tp = inner
        origin = typing.get_origin(tp)
        if origin is Literal:
            choices = typing.get_args(tp)
            if isinstance(v, str) and "bf16" in choices:
                v = _PRECISION_ALIASES.get(v.lower(), v)
            if v in choices and type(v) is type(choices[0]):
                return True, v
            self.err(path, f"{v!r} is not one of {', '.join(map(str, choices))}"
                     + (_suggest(v, choices) if isinstance(v, str) else ""))
            return False, None
        if origin in (Union, types.UnionType):  # tagged unions (prompt sources)
            return self.prompt_source(v, path)
        if origin is list:
            (item_tp,) = typing.get_args(tp)
            if not isinstance(v, list):
                self.err(path, f"expected a list, got {_got(v)}")
                return False, None
            out, ok = [], True
            for i, item in enumerate(v):
                good, parsed = self.value(item_tp, item, _join(path, i))
                ok &= good
                out.append(parsed)
            return ok, out
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, v, path)
        if tp is bool:
            if isinstance(v, bool):
                return True, v
        elif tp is int:
            if isinstance(v, int) and not isinstance(v, bool):
                return self.checked(v, path, check)
        elif tp is float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return self.checked(float(v), path, check)
        elif tp is str:
            if isinstance(v, str):
                if not v.strip():
                    self.err(path, "must not be empty")
                    return False, None
                return True, v
        else:  # pragma: no cover - a schema bug, not a recipe bug
            raise TypeError(f"unsupported schema type {tp!r} at {path}")
        self.err(path, f"expected {_type_name(tp)}, got {_got(v)}")
        return False, None

    def checked(self, v, path, check):
        tests = {"ge": (">=", lambda a, b: a >= b), "gt": (">", lambda a, b: a > b),
                 "le": ("<=", lambda a, b: a <= b), "lt": ("<", lambda a, b: a < b)}
        for op, bound in (check or {}).items():
            sym, good = tests[op]
            if not good(v, bound):
                self.err(path, f"must be {sym} {bound}, got {v}")
                return False, None
        return True, v

    def dataclass(self, cls, v, path: str, *, hint_other: Mapping[str, str] | None = None,
                  section: str | None = None):
        if not isinstance(v, Mapping):
            self.err(path, f"expected a mapping, got {_got(v)}")
            return False, None
        fields = _schema_fields(cls)
        names = [f.name for f, _ in fields]
        ok, kwargs = True, {}
        where = section or (f"in {path}" if path else "at the top level")
        for key in v:
            if key not in names:
                ok = False
                if not isinstance(key, str):
                    self.err(_join(path, str(key)), f"unknown key {key!r} {where} (keys are strings)")
                elif hint_other and key in hint_other:
                    self.err(_join(path, key), f"unknown key {key!r} {where}; {hint_other[key]}")
                else:
                    hint = _suggest(key, names) or f" (valid keys: {', '.join(names)})"
                    self.err(_join(path, key), f"unknown key {key!r} {where}{hint}")
        for f, tp in fields:
            if f.name in v:
                good, parsed = self.value(tp, v[f.name], _join(path, f.name), f.metadata)
                ok &= good
                if good:
                    kwargs[f.name] = parsed
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.err(_join(path, f.name), f"required key {f.name!r} is missing {where}")
                ok = False
        if not ok:
            return False, None
        return True, cls(**kwargs)

    def prompt_source(self, v, path):
        if not isinstance(v, Mapping):
            self.err(path, f"expected a mapping like {{source: magpie, count: 256}}, got {_got(v)}")
            return False, None
        src = v.get("source")
        if src not in PROMPT_SOURCES:
            self.err(_join(path, "source"), f"{src!r} is not one of {', '.join(PROMPT_SOURCES)}"
                     + (_suggest(src, list(PROMPT_SOURCES)) if isinstance(src, str) else ""))
            return False, None
        return self.dataclass(PROMPT_SOURCES[src], v, path, section=f"in {path} (source {src})")

    def speculator(self, method: str, v, path: str = "speculator"):
        cls = SPECULATOR_CLASSES[method]
        if v is None:
            return True, cls()
        own = {f.name for f, _ in _schema_fields(cls)}
        hint = {}
        for other, ocls in SPECULATOR_CLASSES.items():
            for f, _ in _schema_fields(ocls):
                if f.name not in own and f.name not in hint:
                    owners = [m for m, c in SPECULATOR_CLASSES.items()
                              if f.name in {g.name for g, _ in _schema_fields(c)}]
                    hint[f.name] = (f"it is an option of {'/'.join(owners)} speculators, not {method} "
                                    f"(valid keys: {', '.join(sorted(own))})")
        return self.dataclass(cls, v, path, hint_other=hint, section=f"in speculator (method {method})")


def recipe_from_dict(data: Any, source: str = "<dict>", *, name: str | None = None) -> Recipe:
    """Validate a raw mapping (as read from YAML) into a :class:`Recipe`; raises :class:`RecipeError`."""
    p = _Parser()
    if not isinstance(data, Mapping):
        raise RecipeError(source, [("", f"expected a mapping at the top level, got {_got(data)}")])
    data = dict(data)
    method = data.get("method")
    if "method" not in data:
        p.err("method", f"required key 'method' is missing (one of {', '.join(METHODS)})")
    elif method not in METHODS:
        p.err("method", f"{method!r} is not one of {', '.join(METHODS)}"
              + (_suggest(method, METHODS) if isinstance(method, str) else ""))
        method = None
    spec_raw = data.pop("speculator", None)
    ok, recipe = p.dataclass(Recipe, data, "")
    spec_ok, spec = (p.speculator(method, spec_raw) if method in METHODS else (False, None))
    if p.problems:
        raise RecipeError(source, p.problems)
    assert ok and spec_ok
    recipe.speculator = spec
    if not recipe.name:
        recipe.name = name or (Path(source).stem if source and not source.startswith("<") else "recipe")
    recipe.source = source
    problems = _cross_check(recipe)
    if problems:
        raise RecipeError(source, problems)
    return recipe


# --------------------------------------------------------------------------------------------
# cross-field validation
# --------------------------------------------------------------------------------------------

def _cross_check(r: Recipe) -> list[tuple[str, str]]:
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
    if isinstance(s, MedusaSpeculator) and s.choices is not None:
        out += _check_choices(s.choices, s.num_heads)
    if isinstance(s, Medusa2Speculator) and s.lora is not None and not s.lora.target_modules:
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
    for i, src in enumerate(d.prompts):
        if isinstance(src, MagpiePrompts) and src.max_prompt_tokens >= d.max_seq_len:
            out.append((f"data.prompts[{i}].max_prompt_tokens",
                        f"{src.max_prompt_tokens} leaves no room for a response in max_seq_len {d.max_seq_len}"))

    # training
    if tr.max_steps is None and tr.epochs is None:
        out.append(("training", "set max_steps or epochs (max_minutes alone would make the schedule undefined)"))
    if tr.ttt_steps is not None and r.method != "eagle3":
        out.append(("training.ttt_steps", f"training-time-test unrolling is EAGLE-3 only; remove it for {r.method}"))

    # launcher
    out += _check_launcher(r)

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
                        + _suggest(ps, [BUILTIN_HELDOUT])))
    if not ev.temperatures:
        out.append(("evaluation.temperatures", "needs at least one temperature"))
    if any(x < 0 for x in ev.temperatures):
        out.append(("evaluation.temperatures", f"must be >= 0, got {ev.temperatures}"))
    return out


def _check_choices(choices: list[list[int]], num_heads: int) -> list[tuple[str, str]]:
    key = "speculator.choices"
    if not choices:
        return [(key, "must not be empty (null = the runtime's default tree)")]
    paths = {tuple(c) for c in choices}
    for c in choices:
        if not c or any(x < 0 for x in c):
            return [(key, f"every path must be a non-empty list of ranks >= 0, got {c}")]
        if len(c) > num_heads:
            return [(key, f"path {c} is deeper than num_heads {num_heads}")]
        if len(c) > 1 and tuple(c[:-1]) not in paths:
            return [(key, f"path {c} lacks its prefix {c[:-1]} (the tree must be prefix-closed)")]
    if len(paths) != len(choices):
        return [(key, "paths must be distinct")]
    return []


def _known_prompt_count(d: DataConfig) -> int | None:
    """Prompt count when every source states it (magpie count, file/hub limit), else None."""
    total = 0
    for src in d.prompts:
        n = src.count if isinstance(src, MagpiePrompts) else src.limit
        if n is None:
            return None
        total += n
    return total


# --------------------------------------------------------------------------------------------
# launcher configs
# --------------------------------------------------------------------------------------------

def _packaged(*parts: str):
    return resources.files("specfoundry.recipes").joinpath(*parts)


def _named_file(value: str, folder: str, ext: str) -> Path:
    """A packaged launcher config by name, or a path (contains '/' or ends with the extension)."""
    if "/" in value or os.sep in value or value.endswith(ext):
        return Path(value).expanduser()
    return Path(str(_packaged(folder, value + ext)))


def accelerate_config_path(name_or_path: str) -> Path:
    return _named_file(name_or_path, "accelerate", ".yaml")


def deepspeed_config_path(name_or_path: str) -> Path:
    return _named_file(name_or_path, "deepspeed", ".json")


def list_launcher_configs() -> dict[str, list[str]]:
    """``{"accelerate": [...], "deepspeed": [...]}``: the packaged launcher config names."""
    out = {}
    for folder, ext in (("accelerate", ".yaml"), ("deepspeed", ".json")):
        d = _packaged(folder)
        out[folder] = sorted(p.name[: -len(ext)] for p in d.iterdir() if p.name.endswith(ext)) if d.is_dir() else []
    return out


def read_accelerate_config(name_or_path: str) -> dict:
    path = accelerate_config_path(name_or_path)
    cfg = yaml.safe_load(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a YAML mapping")
    return cfg


def read_deepspeed_config(name_or_path: str) -> dict:
    path = deepspeed_config_path(name_or_path)
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object")
    return cfg


def zero_stage(recipe: Recipe) -> int:
    """The recipe's ZeRO stage (0 when the launcher does not use DeepSpeed)."""
    if recipe.launcher.deepspeed is None:
        return 0
    return int(read_deepspeed_config(recipe.launcher.deepspeed).get("zero_optimization", {}).get("stage", 0))


def _check_launcher(r: Recipe) -> list[tuple[str, str]]:
    ln, out = r.launcher, []
    names = list_launcher_configs()
    acc_path = accelerate_config_path(ln.config)
    if not acc_path.is_file():
        return [("launcher.config", f"no accelerate config {ln.config!r} ({acc_path}); packaged: "
                 f"{', '.join(names['accelerate'])}{_suggest(ln.config, names['accelerate'])}")]
    try:
        acc = read_accelerate_config(ln.config)
    except (OSError, ValueError, yaml.YAMLError) as e:
        return [("launcher.config", f"cannot read {acc_path}: {e}")]
    is_ds = acc.get("distributed_type") == "DEEPSPEED"
    stage = 0
    if ln.deepspeed is not None:
        ds_path = deepspeed_config_path(ln.deepspeed)
        if not ds_path.is_file():
            out.append(("launcher.deepspeed", f"no DeepSpeed config {ln.deepspeed!r} ({ds_path}); packaged: "
                        f"{', '.join(names['deepspeed'])}{_suggest(ln.deepspeed, names['deepspeed'])}"))
        else:
            try:
                stage = int(read_deepspeed_config(ln.deepspeed).get("zero_optimization", {}).get("stage", 0))
            except (OSError, ValueError) as e:
                out.append(("launcher.deepspeed", f"cannot read {ds_path}: {e}"))
        if not is_ds:
            out.append(("launcher.deepspeed", f"a ZeRO config needs a DeepSpeed launcher, but accelerate config "
                                              f"{ln.config!r} is distributed_type {acc.get('distributed_type')!r} "
                                              "(use zero2, zero3 or multinode-example)"))
    elif is_ds:
        out.append(("launcher.deepspeed", f"accelerate config {ln.config!r} launches DeepSpeed: name its ZeRO config "
                                          "(zero2, zero3, zero3-offload)"))
    nproc = ln.num_processes or int(acc.get("num_processes", 1))
    nmach = ln.num_machines or int(acc.get("num_machines", 1))
    if nproc % nmach:
        out.append(("launcher.num_processes", f"{nproc} processes do not split evenly over {nmach} machines "
                                              "(num_processes is the total over all machines)"))
    if acc.get("distributed_type") == "NO" and nproc > 1:
        out.append(("launcher.num_processes", f"{nproc} processes with the single-process config {ln.config!r}"))
    use_cpu = bool(acc.get("use_cpu", False))
    if r.training.precision == "fp16" and use_cpu:
        out.append(("training.precision", f"fp16 mixed precision needs CUDA; launcher {ln.config!r} runs on CPU "
                                          "(use bf16 or fp32)"))
    if use_cpu and r.target.device.startswith("cuda"):
        out.append(("target.device", f"{r.target.device} with the CPU launcher {ln.config!r}"))
    pl = r.target.placement
    if pl == "zero3" and stage != 3:
        out.append(("target.placement", "zero3 placement partitions the target with ZeRO-3: set launcher.deepspeed "
                                        "to a stage-3 config (zero3) with a DeepSpeed launcher"))
    if pl == "device_map" and nproc > 1:
        out.append(("target.placement", f"device_map spreads one target over the GPUs of one process; "
                                        f"the launcher starts {nproc}"))
    return out


def launch_args(recipe: Recipe) -> list[str]:
    """``accelerate launch`` options for this recipe (config file, DeepSpeed JSON, process counts,
    mixed precision), all paths absolute. CLI options override the accelerate YAML's values."""
    ln = recipe.launcher
    acc = read_accelerate_config(ln.config)
    args = ["--config_file", str(accelerate_config_path(ln.config).resolve())]
    if ln.deepspeed is not None:
        args += ["--deepspeed_config_file", str(deepspeed_config_path(ln.deepspeed).resolve())]
    args += ["--num_processes", str(ln.num_processes or int(acc.get("num_processes", 1))),
             "--num_machines", str(ln.num_machines or int(acc.get("num_machines", 1))),
             "--mixed_precision", {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[recipe.training.precision]]
    return args


def deepspeed_config_for(recipe: Recipe, hidden_size: int | None = None) -> dict | None:
    """The recipe's DeepSpeed config with every ``"auto"`` filled from the recipe (None without
    DeepSpeed), for ``accelerate.DeepSpeedPlugin(hf_ds_config=...)``.

    Why not leave the autos to accelerate: it fills ``gradient_clipping`` with 1.0 (not
    ``training.grad_clip``), and the bucket sizes from ``model.config.hidden_size``, which a
    speculator module may not have. ``hidden_size`` defaults to the target's (preset or local
    config.json); the bucket formulas are accelerate's own."""
    if recipe.launcher.deepspeed is None:
        return None
    from .presets import resolve_architecture  # local: presets reads files only

    r = resolve(recipe)
    tr = r.training
    cfg = copy.deepcopy(read_deepspeed_config(r.launcher.deepspeed))
    H = hidden_size or resolve_architecture(r.target.name).hidden_size
    fills = {
        "train_micro_batch_size_per_gpu": tr.batch_size,
        "gradient_accumulation_steps": tr.grad_accum,
        "train_batch_size": tr.batch_size * tr.grad_accum * r.launcher.num_processes,
        "gradient_clipping": float(tr.grad_clip or 0.0),  # 0 = no clipping in DeepSpeed
        "bf16.enabled": tr.precision == "bf16",
        "fp16.enabled": tr.precision == "fp16",
        "zero_optimization.reduce_bucket_size": H * H,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * H * H),
        "zero_optimization.stage3_param_persistence_threshold": 10 * H,
    }
    for dotted, value in fills.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for part in parents:
            node = node.get(part, {})
        if node.get(leaf) == "auto":
            node[leaf] = value

    def autos(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from autos(v, f"{prefix}{k}.")
            elif v == "auto":
                yield prefix + k

    left = list(autos(cfg))
    if left:
        raise ValueError(f"DeepSpeed config {r.launcher.deepspeed!r}: no recipe value for 'auto' keys {left}")
    return cfg


# --------------------------------------------------------------------------------------------
# loading, resolving, dumping
# --------------------------------------------------------------------------------------------

def list_recipes() -> list[str]:
    """Names of the packaged recipes (``recipes/<name>.yaml``)."""
    return sorted(p.name[:-5] for p in _packaged().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """The file a recipe name or path refers to (raises :class:`RecipeError` when there is none)."""
    s = str(name_or_path)
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if "/" in s or os.sep in s or s.endswith((".yaml", ".yml")):
        raise RecipeError(s, [("", "no such recipe file")])
    packaged = Path(str(_packaged(s + ".yaml")))
    if packaged.is_file():
        return packaged
    names = list_recipes()
    raise RecipeError(s, [("", f"unknown recipe {s!r}{_suggest(s, names)} (packaged: {', '.join(names)}; "
                               "or pass a path to a YAML file)")])


def _apply_overrides(data: dict, overrides: Mapping[str, Any] | Sequence[str], source: str) -> dict:
    """``{"training.max_steps": 10}`` or ``["training.max_steps=10"]`` (values parsed as YAML);
    list items are addressed by index: ``data.prompts.0.count``."""
    items = []
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        for o in overrides:
            if "=" not in o:
                raise RecipeError(source, [("", f"override {o!r} is not KEY=VALUE (e.g. training.max_steps=10)")])
            k, v = o.split("=", 1)
            items.append((k.strip(), _load_yaml(v, source) if v.strip() else None))
    data = copy.deepcopy(data)
    for key, value in items:
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, (dict, list)):
                raise RecipeError(source, [(".".join(parts[: i + 1]), f"override {key!r} descends into a {_got(nxt)}")])
            node = nxt
        if isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value
    return data


def load_recipe(name_or_path: str | os.PathLike,
                overrides: Mapping[str, Any] | Sequence[str] | None = None) -> Recipe:
    """Load and validate a recipe: a packaged name (``eagle3-smollm2-135m``) or a YAML path.
    ``overrides`` patch the raw YAML before validation, so their errors read the same way."""
    path = recipe_path(name_or_path)
    source = str(path)
    data = _load_yaml(path.read_text(), source)
    if overrides:
        if not isinstance(data, dict):
            raise RecipeError(source, [("", f"expected a mapping at the top level, got {_got(data)}")])
        data = _apply_overrides(data, overrides, source)
    return recipe_from_dict(data, source, name=path.stem)


def prompt_source_dicts(recipe: Recipe) -> list[dict]:
    """``data.prompts`` as plain dicts for ``specfoundry.train.prompts.load_prompts``: the builtin
    topic list is ``topics: None`` there, and a magpie source generates in the responses' dtype."""
    out = []
    for src in recipe.data.prompts:
        d = _to_plain(src)
        if isinstance(src, MagpiePrompts):
            d["topics"] = None if src.topics == "builtin" else src.topics
            d["dtype"] = recipe.data.responses.dtype or recipe.target.dtype
        out.append(d)
    return out


def default_feature_layers(method: str, num_layers: int) -> list[int] | None:
    """The method's default target feature indices (hidden_states indices, 0..L), as the runtime
    heads define them; ``None`` for draft (no features)."""
    L = int(num_layers)
    if method == "eagle3":
        return [min(max(i, 0), L) for i in (2, L // 2, L - 3)]
    if method in ("eagle", "medusa1", "medusa2"):
        return [L]
    return None


def _cache_root() -> Path:
    return Path(os.environ.get("SPECFOUNDRY_CACHE", Path.home() / ".cache" / "specfoundry"))


def resolve(recipe: Recipe) -> Recipe:
    """A copy with every default filled that can be filled without a download: output_dir,
    cache_dir, response dtype, ttt_steps, W&B mode/run name, launcher process counts, draft
    config sizes, and feature layers (when the target's architecture is a preset or local).
    Idempotent. ``speculator.choices: null`` stays null: it names the runtime's default tree."""
    from .presets import PresetError, find_architecture  # local: presets reads files only

    r = copy.deepcopy(recipe)
    r.output_dir = r.output_dir or f"runs/{r.name}"
    r.data.cache_dir = r.data.cache_dir or str(_cache_root() / "data" / r.name)
    r.data.responses.dtype = r.data.responses.dtype or r.target.dtype
    if r.method == "eagle3" and r.training.ttt_steps is None:
        r.training.ttt_steps = 3
    if r.tracking.wandb_mode == "auto":
        r.tracking.wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    r.tracking.run_name = r.tracking.run_name or r.name
    acc = read_accelerate_config(r.launcher.config)
    r.launcher.num_processes = r.launcher.num_processes or int(acc.get("num_processes", 1))
    r.launcher.num_machines = r.launcher.num_machines or int(acc.get("num_machines", 1))
    if r.target.placement == "auto":
        r.target.placement = "zero3" if zero_stage(r) == 3 and r.launcher.num_processes > 1 else "replicate"
    if r.target.device == "auto":
        r.target.device = "cpu" if acc.get("use_cpu") else "cuda"
    if r.method != "draft" and r.target.feature_layers is None:
        try:
            arch = find_architecture(r.target.name)
        except PresetError:
            arch = None
        if arch is not None:
            r.target.feature_layers = default_feature_layers(r.method, arch.num_layers)
    c = getattr(r.speculator, "config", None)
    if isinstance(c, DraftArchConfig):
        c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
        c.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        c.intermediate_size = c.intermediate_size or -(-(8 * c.hidden_size // 3) // 64) * 64
    return r


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.metadata.get("internal")}
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    return obj


class _Dumper(yaml.SafeDumper):
    pass


def _repr_list(dumper, data):
    # short scalar lists inline ([2, 15, 27]) keep the resolved file readable
    flow = all(isinstance(x, (int, float, str)) for x in data) and len(data) <= 16
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _repr_list)


def dump_resolved(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write the resolved recipe (all defaults filled) as YAML. ``path`` is a directory (the
    file is ``recipe.resolved.yaml`` inside it) or a file path. Returns the file written; loading
    it gives back ``resolve(recipe)``."""
    out = Path(path)
    if out.is_dir() or not out.suffix:
        out.mkdir(parents=True, exist_ok=True)
        out = out / RESOLVED_FILENAME
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    resolved = resolve(recipe)
    header = (f"# resolved recipe {resolved.name} (from {recipe.source or 'a dict'}); every default filled.\n"
              f"# rerun: specfoundry train {out}\n")
    body = yaml.dump(resolved.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    out.write_text(header + body)
    return out
