"""The recipe schema: one pydantic model per YAML section, every field documented beside it.

Scope: the models (strict types, ``extra="forbid"``, range constraints on the fields), the
recipe-level validators that pick the speculator section's class from ``method`` and run the
cross-field checks (:mod:`~specfoundry.train.recipe_checks`). Reading YAML, turning pydantic's
errors into :class:`~specfoundry.train.recipe_errors.RecipeError` messages, and resolving
defaults live in :mod:`~specfoundry.train.recipe`; launcher configs in
:mod:`~specfoundry.train.launcher`. No torch import.

Strict means: ``"8"`` is not an integer, ``2.5`` is not an integer, ``"yes"`` is not a boolean,
an empty string is not a name; an integer is accepted where a number is expected. Precision
fields also take the torch spellings (``bfloat16``, ``float32``, ``float16``, ``half``), and
``auto``: bf16 on CUDA and on CPUs that multiply bfloat16 natively, else fp32
(:mod:`~specfoundry.train.hardware`; :func:`~specfoundry.train.recipe.resolve` fills it in).

Relative paths inside a recipe (prompt files, evaluation sets, ``output_dir``) are kept as
written and resolve against the working directory of the run (the repository root under
``make``), not against the recipe file.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal, Mapping, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag,
                      model_validator)
from pydantic_core import PydanticCustomError

from .recipe_checks import BUILTIN_HELDOUT, cross_check

__all__ = [
    "Recipe", "TargetConfig", "Eagle3Speculator", "EagleSpeculator", "MedusaSpeculator", "Medusa2Speculator",
    "DraftSpeculator", "DraftArchConfig", "LoraConfig", "MagpiePrompts", "FilePrompts", "HubPrompts",
    "ResponsesConfig", "DataConfig", "TrainingConfig", "LauncherConfig", "TrackingConfig", "EvaluationConfig",
    "METHODS", "BUILTIN_HELDOUT", "SPECULATOR_CLASSES", "PROMPT_SOURCES",
]

Method = Literal["eagle3", "eagle", "medusa1", "medusa2", "draft"]
METHODS: tuple[str, ...] = typing.get_args(Method)
# accepted spellings -> canonical (torch names are what people type from habit)
_PRECISION_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def _precision_alias(v):
    return _PRECISION_ALIASES.get(v.lower(), v) if isinstance(v, str) else v


def _non_empty(v: str) -> str:
    if not v.strip():
        raise PydanticCustomError("empty_string", "must not be empty")
    return v


def _shape_candidate(v: str) -> str:
    # imported only for a recipe that names its candidates (it loads the runtime package)
    from specfoundry.runtime.adaptive import parse_shape_candidate

    try:
        parse_shape_candidate(v)
    except ValueError as exc:
        raise PydanticCustomError("shape_candidate", str(exc)) from None
    return v


ShapeCandidate = Annotated[str, AfterValidator(_shape_candidate)]
Precision = Annotated[Literal["auto", "fp32", "bf16", "fp16"], BeforeValidator(_precision_alias)]
Str = Annotated[str, AfterValidator(_non_empty)]


class _Section(BaseModel):
    """One recipe section: strict types, unknown keys are errors."""
    model_config = ConfigDict(extra="forbid", strict=True)


class TargetConfig(_Section):
    # built-in name ("smollm2-135m"), a local HF directory, or a hub id (presets cover the dry run)
    name: Str = "smollm2-135m"
    # Hub revision (branch, tag or commit) a Hub id is pinned to (None: main); unused otherwise
    revision: Str | None = None
    # dtype the frozen target runs in for data generation, hidden-state capture and evaluation;
    # labels should come from the dtype you serve in (bf16 and fp32 argmax differ on ~2%); auto:
    # bf16 where this machine multiplies it natively, else fp32 (emulated bf16 is 4-6x slower batched)
    dtype: Precision = "auto"
    # target hidden_states indices fed to the speculator; None = the method's default
    # (eagle3: 2, L//2, L-3; eagle/medusa: L, the final normed state); unused by draft
    feature_layers: list[int] | None = None
    # auto | cpu | mps | cuda | cuda:N ; auto follows the launcher (use_cpu -> cpu, else cuda)
    device: Str = "auto"
    # how the frozen target is placed for online hidden states when several processes train:
    # replicate (full copy per process), zero3 (partitioned with the head by DeepSpeed ZeRO-3,
    # gathered layer by layer in the forward), device_map (one process, layers spread over the
    # visible GPUs). auto: zero3 under a ZeRO-3 launcher, else replicate
    placement: Literal["auto", "replicate", "zero3", "device_map"] = "auto"


class Eagle3Speculator(_Section):
    # reduced draft vocabulary (most frequent target tokens in the training responses; d2t/t2d maps)
    draft_vocab_size: int = Field(32000, ge=1)
    # decoder layers in the head (EAGLE-3 uses 1; the first reads cat(embed, fused feature), 2H wide)
    num_layers: int = Field(1, ge=1)
    # copy this target layer's weights into the head's layer (None: random init); the wider
    # first-layer q/k/v inputs get the copied weights on the feature half
    init_from_target_layer: int | None = Field(None, ge=0)


class EagleSpeculator(_Section):
    # decoder layers in the head (EAGLE-1 uses 1)
    num_layers: int = Field(1, ge=1)
    # copy this target layer's weights into the head's layer (None: random init)
    init_from_target_layer: int | None = Field(None, ge=0)
    # weight of the smooth-L1 regression onto the next target feature (EAGLE's w_reg)
    feature_loss_weight: float = Field(1.0, ge=0)
    # weight of the token cross-entropy through the target's LM head (EAGLE's w_cls)
    token_loss_weight: float = Field(0.1, ge=0)


class MedusaSpeculator(_Section):
    # K heads; head k predicts the token k+1 steps after the target's own next token
    num_heads: int = Field(4, ge=1)
    # residual blocks per head
    num_layers: int = Field(1, ge=1)
    # each head's LM head over the N most frequent target tokens of the training data (EAGLE-3's
    # draft vocabulary; the d2t map is saved with the heads); None = the full vocabulary (Medusa's)
    draft_vocab_size: int | None = Field(None, ge=1)
    # static tree as paths of per-head ranks, e.g. [[0], [0, 0], [1]]; must be prefix-closed.
    # "fit" (medusa1): the 24 paths most often right on the held-out sequences, measured on the
    # trained heads (train/methods/medusa.py). Either is saved with the heads and is their default.
    # None = the runtime's default tree (runtime.speculators.medusa.default_medusa_choices)
    choices: list[list[int]] | Literal["fit"] | None = None


class LoraConfig(_Section):
    # LoRA rank
    r: int = Field(16, ge=1)
    # LoRA scaling numerator (scale = alpha / r)
    alpha: int = Field(32, ge=1)
    # dropout on the LoRA input
    dropout: float = Field(0.05, ge=0, lt=1)
    # target module names inside each decoder layer (peft's target_modules)
    target_modules: list[Str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


class Medusa2Speculator(MedusaSpeculator):
    # LoRA on the backbone (required for medusa2: the backbone trains jointly with the heads)
    lora: LoraConfig | None = None
    # merge the LoRA weights into the saved backbone (else save the adapter beside the heads)
    merge: bool = False
    # lambda_0 of the Medusa-2 joint loss: L_lm + heads_loss_weight * sum_k w^k L_k
    heads_loss_weight: float = Field(0.2, ge=0)
    # steps that train the heads alone before the backbone LoRA joins (Medusa-2's warm-up)
    heads_warmup_steps: int = Field(0, ge=0)


class DraftArchConfig(_Section):
    # hidden width of the draft
    hidden_size: int = Field(ge=1)
    # decoder layers of the draft
    num_layers: int = Field(ge=1)
    # attention heads
    num_attention_heads: int = Field(ge=1)
    # KV heads (None: = num_attention_heads)
    num_key_value_heads: int | None = Field(None, ge=1)
    # MLP width (None: 8/3 * hidden_size rounded up to a multiple of 64, Llama's rule)
    intermediate_size: int | None = Field(None, ge=1)
    # per-head dim (None: hidden_size // num_attention_heads)
    head_dim: int | None = Field(None, ge=1)


class DraftSpeculator(_Section):
    # initialise from these target layers (ascending, distinct), plus the target's embedding,
    # final norm and LM head; exactly one of layers / config / init_from
    layers: list[int] | None = None
    # or a fresh Llama-style model of this shape (vocabulary = the target's)
    config: DraftArchConfig | None = None
    # or a pretrained model sharing the target's tokenizer (preset name, local dir or hub id)
    init_from: Str | None = None
    # distillation loss on the target's logits: forward KL(p_target || q_draft) or total variation
    # (TV bounds the acceptance rate directly: accept = 1 - TV)
    kd_loss: Literal["forward_kl", "tv"] = "forward_kl"
    # softmax temperature applied to both logits inside the KD loss
    temperature: float = Field(1.0, gt=0)


SPECULATOR_CLASSES: dict[str, type[_Section]] = {
    "eagle3": Eagle3Speculator, "eagle": EagleSpeculator, "medusa1": MedusaSpeculator,
    "medusa2": Medusa2Speculator, "draft": DraftSpeculator,
}
_SPECULATOR_TAG = {cls: method for method, cls in SPECULATOR_CLASSES.items()}


class _ForMethod(dict):
    """A raw ``speculator`` mapping tagged with the recipe's method: which class parses it."""

    def __init__(self, raw, method: str):
        super().__init__(raw)
        self.method = method


def _speculator_tag(v) -> str | None:
    if isinstance(v, _ForMethod):
        return v.method
    return _SPECULATOR_TAG.get(type(v))


# the speculator section's class is chosen by the recipe's ``method`` (tagged in Recipe._tag_speculator)
SpeculatorConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(method)] for method, cls in SPECULATOR_CLASSES.items())],
    Discriminator(_speculator_tag, custom_error_type="speculator_mapping",
                  custom_error_message="expected a mapping of the method's speculator options")]


class MagpiePrompts(_Section):
    source: Literal["magpie"] = "magpie"
    # prompts to synthesize with the target itself (Magpie: the chat template's user-turn prefix)
    count: int = Field(256, ge=1)
    # seed topics for diversity: "builtin" or a text file with one topic per line
    topics: Str = "builtin"
    # sampling seed (prompt i uses seed + i, so counts can grow without reshuffling)
    seed: int = 0
    # cap on each synthesized prompt
    max_prompt_tokens: int = Field(64, ge=1)
    # sampling temperature / nucleus for the prompt writer (diversity matters more than quality)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.95, gt=0, le=1)


class FilePrompts(_Section):
    source: Literal["file"] = "file"
    # local JSON/JSONL: ShareGPT `conversations`, Spec-Bench/MT-bench `turns`, `prompt`,
    # `question` or `instruction` records; the first user turn is the prompt
    path: Str = Field()
    # first N usable records (None: all)
    limit: int | None = Field(None, ge=1)
    # take `limit` records at random (seeded by training.seed) instead of the first: for files
    # sorted by language, length or topic
    shuffle: bool = False


class HubPrompts(_Section):
    source: Literal["hub"] = "hub"
    # datasets hub name (needs network or a populated HF datasets cache)
    name: Str = Field()
    # dataset configuration (datasets' second argument, e.g. a language pair)
    subset: Str | None = None
    split: Str = "train"
    # first N usable records (None: all)
    limit: int | None = Field(None, ge=1)
    # take `limit` records at random (seeded by training.seed) instead of the first
    shuffle: bool = False


PROMPT_SOURCES: dict[str, type] = {"magpie": MagpiePrompts, "file": FilePrompts, "hub": HubPrompts}
PromptSource = Annotated[Union[MagpiePrompts, FilePrompts, HubPrompts], Field(discriminator="source")]


class ResponsesConfig(_Section):
    # self-distilled response length cap (the target writes every training response)
    max_new_tokens: int = Field(256, ge=1)
    # 0 = greedy (labels equal the target's argmax); > 0 samples
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # with temperature 0: this share of the prompts (picked by a hash of the prompt's text) is
    # answered by sampling at sampled_temperature (and top_p) instead, so the head also trains on
    # the contexts it drafts in when serving at T > 0 (the labels stay the target's distribution)
    sampled_fraction: float = Field(0.0, ge=0, le=1)
    sampled_temperature: float = Field(1.0, gt=0)
    # prompts per batched generate call (left padding)
    batch_size: int = Field(32, ge=1)
    # dtype of the generating target (None: target.dtype)
    dtype: Precision | None = None


class DataConfig(_Section):
    # prompt sources, concatenated in order; each is {source: magpie|file|hub, ...}
    prompts: list[PromptSource] = Field(default_factory=lambda: [MagpiePrompts()])
    # response generation (self-distillation by the target)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    # prompt + response tokens per training sequence (longer ones are truncated)
    max_seq_len: int = Field(2048, ge=8)
    # prompts held out of training (the "builtin-heldout" evaluation set and eval loss)
    eval_prompts: int = Field(32, ge=0)
    # online: the frozen target runs inside each step; offline: features are precomputed to
    # sharded files once, then reused every epoch (same dataset interface for both)
    hidden_states: Literal["online", "offline"] = "online"
    # put loss on prompt positions too (more signal per sequence when data is scarce)
    loss_on_prompt: bool = False
    # where prompts, responses and feature shards are cached (None: $SPECFOUNDRY_CACHE/data/<name>)
    cache_dir: Str | None = None
    # wall budget for data generation; stops early and trains on what exists (None: no cap)
    max_minutes: float | None = Field(None, gt=0)
    # offline capture: sequences per target forward (1: one unpadded forward each, bit-identical
    # to online; > 1: length-sorted padded batches, same values up to rounding, ~2x faster on CPU)
    capture_batch_size: int = Field(1, ge=1)


class TrainingConfig(_Section):
    # optimizer steps (None: from epochs); with both set, whichever ends first
    max_steps: int | None = Field(None, ge=1)
    # passes over the training sequences (may be fractional)
    epochs: float | None = Field(None, gt=0)
    # wall budget for the training loop; checkpoints and stops when reached (None: no cap)
    max_minutes: float | None = Field(None, gt=0)
    # sequences per micro-batch per process
    batch_size: int = Field(8, ge=1)
    # micro-batches per optimizer step
    grad_accum: int = Field(1, ge=1)
    # AdamW peak learning rate
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    # decay after warm-up
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    seed: int = 0
    # EAGLE-3 training-time test: how many draft steps are unrolled on the head's own outputs
    # (None: 3 for eagle3; other methods must leave it unset)
    ttt_steps: int | None = Field(None, ge=1)
    # loss weight of draft position i is position_weight_decay ** i (EAGLE-3 unroll steps,
    # Medusa heads); 0.8 as in both papers
    position_weight_decay: float = Field(0.8, gt=0, le=1)
    # max gradient norm (None: no clipping)
    grad_clip: float | None = Field(0.5, gt=0)
    # recompute activations in the backward (for medusa2 / draft where the backbone trains)
    gradient_checkpointing: bool = False
    # save every N steps (0: only at the end and when max_minutes is reached)
    checkpoint_every: int = Field(0, ge=0)
    log_every: int = Field(10, ge=1)
    # evaluate the held-out loss / acceptance every N steps (0: only at the end)
    eval_every: int = Field(0, ge=0)
    # fp32, or bf16/fp16 mixed precision (fp16 needs CUDA); auto: as target.dtype's auto, except fp32 on an
    # Intel CPU without AMX, where bf16 products are slower than fp32 ones (train/hardware.py)
    precision: Precision = "auto"


class LauncherConfig(_Section):
    # accelerate config: a name in recipes/accelerate/ (single-cpu, single-gpu, ddp-2proc, ddp-gpu,
    # zero2, zero3, multinode-example) or a path to a YAML file
    config: Str = "single-cpu"
    # DeepSpeed JSON: a name in recipes/deepspeed/ (zero2, zero3, zero3-offload) or a path;
    # required exactly when the accelerate config is a DeepSpeed one
    deepspeed: Str | None = None
    # total processes over all machines (None: the accelerate config's num_processes)
    num_processes: int | None = Field(None, ge=1)
    # machines (None: the accelerate config's num_machines)
    num_machines: int | None = Field(None, ge=1)
    # this machine's rank, 0 on the main one (None: the accelerate config's machine_rank); with
    # several machines the same recipe runs on each, with --set launcher.machine_rank=N
    machine_rank: int | None = Field(None, ge=0)
    # address and port of machine_rank 0 (None: the accelerate config's)
    main_process_ip: Str | None = None
    main_process_port: int | None = Field(None, ge=1, le=65535)
    # memory of one device in GB, for the plan's fit check only (None: not checked)
    device_memory_gb: float | None = Field(None, gt=0)


class TrackingConfig(_Section):
    wandb_project: Str = "specfoundry"
    wandb_entity: Str | None = None
    # auto: online when WANDB_API_KEY is set, else offline; disabled: no tracker
    wandb_mode: Literal["auto", "offline", "online", "disabled"] = "auto"
    # W&B run name (None: the recipe name)
    run_name: Str | None = None
    # upload checkpoints as W&B artifacts
    log_model: bool = False


class EvaluationConfig(_Section):
    # "builtin-heldout" (data.eval_prompts held out of training) and/or JSON/JSONL prompt files,
    # e.g. ../shared/data/eval/mt_bench/question.jsonl
    prompt_sets: list[Str] = Field(default_factory=lambda: [BUILTIN_HELDOUT])
    # prompts per set
    limit: int = Field(20, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    # sampling temperatures to measure acceptance at (0.0 = greedy)
    temperatures: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    # draft depth k (tokens proposed per step)
    depth: int = Field(5, ge=1)
    # EAGLE drafters: "dynamic" (EAGLE-2 tree) or "chain"; tree size including the root, and
    # children per expanded node (None: the drafter's defaults)
    tree: Literal["dynamic", "chain"] | None = None
    total_tokens: int | None = Field(None, ge=2)
    top_k: int | None = Field(None, ge=1)
    # let the runtime pick the depth per step from measured acceptance and costs; off gives the
    # fixed draft shape above, so tau measures the speculator rather than the controller
    adaptive: bool = True
    # also decode without speculation, for the speedup ratio
    baseline: bool = True
    # wall budget for evaluation (None: no cap)
    max_minutes: float | None = Field(None, gt=0)
    # EAGLE heads: after tau, time these shapes against plain decoding on the held-out prompts
    # (greedy, prompt lookup first) and store the fastest as the checkpoint's runtime default
    # (training.runtime_shape; runtime/tune.py); "adaptive" is the shape above under the controller
    # (the runtime's RUNTIME_SHAPE_CANDIDATES, written out: importing the runtime here would load
    # torch and transformers into the dry run; a test keeps the two equal)
    runtime_shapes: list[ShapeCandidate] = Field(
        default_factory=lambda: ["tree@2/4", "adaptive", "chain@2", "chain@3", "tree@2/6", "tree@3/8"])
    # held-out prompts for that (0: skip it) and its wall budget
    runtime_prompts: int = Field(8, ge=0)
    runtime_max_minutes: float | None = Field(1.5, gt=0)
    # EAGLE heads: the request temperatures at which the draft temperature is calibrated on the same
    # held-out prompts (runtime/calibrate.py; stored as training.draft_temperature; empty: skip it)
    draft_temperatures: list[Annotated[float, Field(gt=0)]] = Field(default_factory=lambda: [0.7, 1.0])


class Recipe(_Section):
    # recipe name (empty: the file stem); names runs, caches and W&B
    name: Str = ""
    # one line for humans (printed by the dry run)
    description: Str = ""
    # eagle3 | eagle (EAGLE-1) | medusa1 | medusa2 | draft
    method: Method = Field()
    # where checkpoints and the resolved recipe go (None: runs/<name>)
    output_dir: Str | None = None
    target: TargetConfig = Field(default_factory=TargetConfig)
    # method-specific architecture options (None: the method's defaults)
    speculator: SpeculatorConfig | None = None
    data: DataConfig = Field(default_factory=DataConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    # the file this recipe came from (not part of the schema, not compared)
    _source: str | None = PrivateAttr(default=None)

    @property
    def source(self) -> str | None:
        return self._source

    @source.setter
    def source(self, value: str | None) -> None:
        self._source = value

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self.__dict__ == other.__dict__

    __hash__ = None

    @model_validator(mode="before")
    @classmethod
    def _tag_speculator(cls, data):
        """Hand ``speculator`` to the class of ``method`` (missing or null: that class's defaults)."""
        if isinstance(data, Mapping) and data.get("method") in SPECULATOR_CLASSES:
            spec = data.get("speculator")
            if spec is None:
                spec = {}
            if isinstance(spec, Mapping) and not isinstance(spec, _ForMethod):
                data = {**data, "speculator": _ForMethod(spec, data["method"])}
        elif isinstance(data, Mapping) and "speculator" in data:
            data = {k: v for k, v in data.items() if k != "speculator"}  # unknown method: reported alone
        return data

    @model_validator(mode="after")
    def _cross_checks(self):
        """Every cross-field problem at once (see :mod:`specfoundry.train.recipe_checks`)."""
        problems = cross_check(self)
        if problems:
            raise PydanticCustomError("recipe_cross_check", "{count} cross-field problem(s)",
                                      {"count": len(problems), "problems": problems})
        return self

    def to_dict(self) -> dict:
        """Plain dict in schema order (what the YAML holds), without internal fields."""
        return self.model_dump(mode="python")
