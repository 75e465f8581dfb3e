"""Sizes and memory of a training plan: parameter counts of the speculator and the memory one
device needs (the numbers :func:`~specfoundry.train.plan.make_plan` assembles).

Scope: :func:`speculator_size` (total and trainable parameters per method), the shape checks of
a recipe against its target's architecture (:func:`architecture_problems`) and the per-device
memory model (:func:`memory_per_device`, activations included). Assumptions are stated in
:mod:`~specfoundry.train.plan`'s docstring (the ZeRO paper's accounting for Adam, SDPA
activations). Pure arithmetic over a resolved recipe and an
:class:`~specfoundry.train.presets.Architecture`: no torch, no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .presets import Architecture, PresetError, resolve_architecture
from .recipe import (DraftSpeculator, Eagle3Speculator, EagleSpeculator, Medusa2Speculator, MedusaSpeculator, Recipe,
                     default_feature_layers)

__all__ = ["SpeculatorSize", "Memory", "speculator_size", "architecture_problems", "memory_per_device", "GB", "BYTES"]

GB = 1e9
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OVERHEAD = {"cuda": 2.0 * GB, "mps": 1.0 * GB, "cpu": 0.5 * GB}  # CUDA context + allocator slack / Python + torch


@dataclass
class SpeculatorSize:
    description: str
    total: int  # parameters the speculator's checkpoint holds (draft: the whole draft model)
    trainable: int  # parameters the optimizer updates
    layer_params: int  # the largest trainable layer (ZeRO-3 gathers one at a time)


@dataclass
class Memory:
    """Bytes per device for one ZeRO stage (``total`` excludes what is offloaded to host)."""

    zero_stage: int
    world_size: int
    placement: str
    target_weights: float
    trainable_weights: float
    gradients: float
    optimizer_states: float
    activations: float
    gather_buffers: float
    overhead: float
    offloaded: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.target_weights + self.trainable_weights + self.gradients + self.optimizer_states
                + self.activations + self.gather_buffers + self.overhead)


# --------------------------------------------------------------------------------------------
# parameters
# --------------------------------------------------------------------------------------------

def _draft_arch(spec: DraftSpeculator, target: Architecture) -> Architecture:
    if spec.init_from is not None:
        return resolve_architecture(spec.init_from)
    if spec.layers is not None:
        return Architecture(**{**target.to_dict(), "name": f"{target.name} layers {spec.layers}",
                               "num_layers": len(spec.layers)})
    c = spec.config
    return Architecture(name="draft", hidden_size=c.hidden_size, num_layers=c.num_layers,
                        num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads or c.num_attention_heads,
                        intermediate_size=c.intermediate_size or -(-(8 * c.hidden_size // 3) // 64) * 64,
                        vocab_size=target.vocab_size, head_dim=c.head_dim,
                        tie_word_embeddings=target.tie_word_embeddings)


def speculator_size(recipe: Recipe, target: Architecture) -> SpeculatorSize:
    """Parameter counts of the recipe's speculator for ``target`` (mirrors runtime/speculators)."""
    s, A = recipe.speculator, target
    H = A.hidden_size
    F = len(recipe.target.feature_layers or default_feature_layers(recipe.method, A.num_layers) or [])
    if isinstance(s, Eagle3Speculator):
        # F feature norms + fc (F*H -> H, no bias); first layer's attention reads cat(embed, h): 2H;
        # three norms in that layer; output norm; lm_head over the draft vocabulary
        first = A.attention_params(2 * H) + A.mlp_params() + 3 * H
        rest = (s.num_layers - 1) * A.layer_params()
        n = F * H + F * H * H + first + rest + H + H * s.draft_vocab_size
        return SpeculatorSize(f"EAGLE-3 head: {s.num_layers} layer(s), features {F}, draft vocab {s.draft_vocab_size}",
                              n, n, max(first, A.layer_params() if s.num_layers > 1 else 0))
    if isinstance(s, EagleSpeculator):
        # fc (2H -> H, bias) + decoder layers without the input norm; the target's lm_head is reused
        layer = A.layer_params() - H
        n = 2 * H * H + H + s.num_layers * layer
        return SpeculatorSize(f"EAGLE-1 head: {s.num_layers} layer(s)", n, n, layer)
    if isinstance(s, MedusaSpeculator):
        Vd = min(s.draft_vocab_size or A.vocab_size, A.vocab_size)
        per_head = s.num_layers * (H * H + H) + H * Vd
        heads = s.num_heads * per_head
        desc = f"Medusa heads: {s.num_heads} x ({s.num_layers} block(s) + own LM head" \
            + (f" over a {Vd}-token draft vocabulary)" if Vd < A.vocab_size else ")")
        if isinstance(s, Medusa2Speculator) and s.lora is not None:
            shapes = A.linear_shapes()
            lora = A.num_layers * sum(s.lora.r * (i + o) for m, (i, o) in shapes.items() if m in s.lora.target_modules)
            missing = sorted(set(s.lora.target_modules) - set(shapes))
            desc += f" + LoRA r={s.lora.r} on {', '.join(s.lora.target_modules)}"
            if missing:
                desc += f" (not counted: {', '.join(missing)})"
            return SpeculatorSize(desc, heads + lora, heads + lora, H * A.vocab_size)
        return SpeculatorSize(desc, heads, heads, H * A.vocab_size)
    if isinstance(s, DraftSpeculator):
        d = _draft_arch(s, A)
        n = d.param_count()
        how = (f"from {s.init_from}" if s.init_from else f"from target layers {s.layers}" if s.layers is not None
               else "fresh config")
        desc = f"draft model ({how}): {d.num_layers} layers, hidden {d.hidden_size}"
        return SpeculatorSize(desc, n, n, max(d.layer_params(), d.embedding_params()))
    raise TypeError(f"unknown speculator {type(s).__name__}")  # pragma: no cover


def architecture_problems(recipe: Recipe, target: Architecture) -> list[tuple[str, str]]:
    """Recipe checks that need the target's shape (layer indices, vocabularies)."""
    out, s, L = [], recipe.speculator, target.num_layers
    fl = recipe.target.feature_layers
    if fl is not None and recipe.method != "draft":
        bad = [i for i in fl if not 0 <= i <= L]
        if bad:
            out.append(("target.feature_layers", f"{bad} outside [0, {L}] (hidden_states indices of a {L}-layer target)"))
        if recipe.method in ("eagle", "medusa1", "medusa2") and fl != [L]:
            out.append(("target.feature_layers", f"{recipe.method} reads the final normed state: [{L}], got {fl}"))
    if isinstance(s, MedusaSpeculator) and (s.draft_vocab_size or 0) > target.vocab_size:
        out.append(("speculator.draft_vocab_size", f"{s.draft_vocab_size} exceeds the target vocabulary {target.vocab_size}"))
    if isinstance(s, Eagle3Speculator) and s.draft_vocab_size > target.vocab_size:
        out.append(("speculator.draft_vocab_size", f"{s.draft_vocab_size} exceeds the target vocabulary {target.vocab_size}"))
    if isinstance(s, (Eagle3Speculator, EagleSpeculator)) and s.init_from_target_layer is not None \
            and s.init_from_target_layer >= L:
        out.append(("speculator.init_from_target_layer", f"{s.init_from_target_layer} is not a layer of a {L}-layer target"))
    if isinstance(s, DraftSpeculator):
        if s.layers is not None and max(s.layers) >= L:
            out.append(("speculator.layers", f"{[i for i in s.layers if i >= L]} are not layers of a {L}-layer target"))
        if s.init_from is not None:
            try:
                d = resolve_architecture(s.init_from)
            except PresetError as e:
                out.append(("speculator.init_from", str(e)))
            else:
                if d.vocab_size != target.vocab_size:
                    out.append(("speculator.init_from", f"{s.init_from} has vocabulary {d.vocab_size}, the target "
                                                        f"{target.vocab_size}: a draft must share the tokenizer"))
    if isinstance(s, Medusa2Speculator) and s.lora is not None:
        unknown = sorted(set(s.lora.target_modules) - set(target.linear_shapes()))
        if unknown:
            out.append(("speculator.lora.target_modules",
                        f"{unknown} are not linear layers of the target (have {sorted(target.linear_shapes())})"))
    return out


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------

def _layer_activation_elems(A: Architecture, input_width: int | None = None) -> int:
    """Saved-for-backward elements per token of one Llama layer: norm in/out, q/k/v, attention
    out, o_proj out, post-norm, gate/up/act/product (SDPA keeps no seq^2 matrix)."""
    i = input_width or A.hidden_size
    return 2 * i + 2 * A.hidden_size + 2 * A.q_dim + 2 * A.kv_dim + 4 * A.intermediate_size


def _activations(r: Recipe, A: Architecture, spec: SpeculatorSize, device: str) -> tuple[float, list[str]]:
    tr, d, s = r.training, r.data, r.speculator
    tokens = tr.batch_size * d.max_seq_len
    act = BYTES[tr.precision]
    tb = BYTES[r.target.dtype]
    H, V = A.hidden_size, A.vocab_size
    F = len(r.target.feature_layers or default_feature_layers(r.method, A.num_layers) or [])
    notes = [f"activations for a micro-batch of {tr.batch_size} x {d.max_seq_len} tokens"]
    logit = act + 4 + 4  # logits + fp32 log-softmax + their gradient
    total = 0.0
    # the frozen target's forward (no grad): one layer's working set + captured features
    if d.hidden_states == "online" or r.method in ("medusa2", "draft"):
        total += tokens * (4 * H + 3 * A.intermediate_size) * tb + F * tokens * H * tb
    else:
        total += (F + 1) * tokens * H * tb  # features read back from the offline shards
    if isinstance(s, Eagle3Speculator):
        steps = tr.ttt_steps or 3
        per_step = _layer_activation_elems(A, 2 * H) * act + 2 * H * act + s.draft_vocab_size * logit
        total += tokens * (F * H * act + steps * per_step + V * tb + s.draft_vocab_size * 4)
        notes.append(f"EAGLE-3 unroll x{steps} (ttt_steps), target distribution over the full vocabulary")
    elif isinstance(s, EagleSpeculator):
        total += tokens * (s.num_layers * _layer_activation_elems(A) * act + 2 * H * act + V * logit)
    elif isinstance(s, MedusaSpeculator):
        total += tokens * s.num_heads * (s.num_layers * 3 * H * act + min(s.draft_vocab_size or V, V) * logit)
        if isinstance(s, Medusa2Speculator):
            total += tokens * V * (tb + 4)  # the original model's logits (LM self-distillation)
            total += _backbone_activations(tokens, A, A.num_layers, act, tr.gradient_checkpointing, notes)
    elif isinstance(s, DraftSpeculator):
        dA = _draft_arch(s, A)
        total += _backbone_activations(tokens, dA, dA.num_layers, act, tr.gradient_checkpointing, notes)
        total += tokens * (V * logit + V * (tb + 4))  # draft logits + target logits for the KD loss
    return total, notes


def _backbone_activations(tokens, A: Architecture, layers: int, act: int, checkpointing: bool, notes) -> float:
    if checkpointing:
        notes.append("gradient checkpointing: one layer input per layer kept, one layer recomputed at a time")
        return tokens * (layers * A.hidden_size + _layer_activation_elems(A)) * act
    return tokens * layers * _layer_activation_elems(A) * act


def memory_per_device(r: Recipe, A: Architecture, spec: SpeculatorSize, stage: int, world: int, placement: str,
            device: str, ds: dict | None) -> Memory:
    notes: list[str] = []
    tb = BYTES[r.target.dtype]
    N = max(world, 1)
    # which parts of the target the training step holds
    offline = r.data.hidden_states == "offline" and r.method not in ("medusa2", "draft")
    if offline:
        shared = A.embedding_params()  # the head embeds tokens with the target's embedding
        if r.method in ("eagle", "eagle3"):
            shared += A.lm_head_params()  # target logits from the stored final feature
        target_bytes = shared * tb
        notes.append("offline hidden states: the step holds only the target's embedding/LM head; the "
                     f"capture pass beforehand holds the whole target ({A.param_count() * tb / GB:.1f} GB)")
    else:
        target_bytes = A.param_count() * tb
    if placement == "zero3" and not offline:
        # train/zero3_target.py: every parameter but the LM head partitioned 1/N; whole copies of
        # the LM head and the input embedding beside them (the speculator reads both every step)
        whole = A.embedding_params() + A.lm_head_params()
        target_bytes = ((A.param_count() - A.lm_head_params()) / N + whole) * tb
        notes.append(f"frozen target partitioned over {N} processes by ZeRO-3, plus whole copies of its embedding"
                     f"{' and LM head' if A.lm_head_params() else ' (tied LM head)'} ({whole * tb / GB:.2f} GB); the "
                     f"main process holds the whole target ({A.param_count() * tb / GB:.1f} GB, over the machine's "
                     "GPUs) for data generation, saving and the final evaluation, before and after training")
    elif placement == "zero3":
        target_bytes /= N
        notes.append(f"frozen target partitioned over {N} processes by ZeRO-3")
    elif placement == "device_map":
        notes.append("frozen target spread over the visible GPUs by device_map: per-GPU share = this / GPU count")
    # the trainable speculator
    P = spec.trainable
    use_ds = ds is not None or stage > 0
    if r.training.precision == "fp32":
        w, g, o = 4, 4, 8
    elif use_ds:
        w, g, o = 2, 2, 12  # bf16/fp16 weights and grads; fp32 master + Adam m, v
    else:
        w, g, o = 4, 4, 8  # autocast keeps fp32 parameters
    weights, grads, optim = P * w, P * g, P * o
    if stage >= 1:
        optim /= N
    if stage >= 2:
        grads /= N
    if stage >= 3:
        weights /= N
    offloaded = 0.0
    zo = (ds or {}).get("zero_optimization", {})
    if stage >= 2 and zo.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        offloaded += optim
        optim = 0.0
        notes.append("optimizer states offloaded to host memory")
    if stage == 3 and zo.get("offload_param", {}).get("device") in ("cpu", "nvme"):
        offloaded += weights + (target_bytes if placement == "zero3" else 0)
        weights = 0.0
        if placement == "zero3":
            target_bytes = 0.0
        notes.append("parameters offloaded to host memory (gathered to the GPU layer by layer)")
    gather = 0.0
    if stage == 3 and N > 1:
        # the all-gathered layer in use plus the one being prefetched (a partitioned target's
        # forward gathers its layers and its embedding the same way)
        layer = max(spec.layer_params * w,
                    max(A.layer_params(), A.embedding_params()) * tb if placement == "zero3" else 0)
        gather = 2 * layer
    acts, act_notes = _activations(r, A, spec, device)
    return Memory(zero_stage=stage, world_size=N, placement=placement, target_weights=target_bytes,
                  trainable_weights=weights, gradients=grads, optimizer_states=optim, activations=acts,
                  gather_buffers=gather, overhead=_OVERHEAD[device], offloaded=offloaded, notes=notes + act_notes)
