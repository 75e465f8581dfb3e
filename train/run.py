"""One training run end to end (what ``accelerate launch -m specfoundry.train.run`` executes):
resolve the recipe, build the data, train the method, save the speculator, measure tau.

Run directory ``runs/<recipe>/``: ``recipe.resolved.yaml``, ``checkpoints/``, ``speculator/``
(what ``load_drafter(path)`` loads), ``train_summary.json`` and the W&B run (``wandb/``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch


def _command_line(argv: list[str]) -> str:
    """The ``specfoundry train ...`` line that reruns this run: argv is ``[specfoundry, train, ...]``
    from the CLI and ``[-m module, recipe, ...]`` under accelerate/torchrun."""
    rest = argv[2:] if len(argv) > 1 and argv[1] == "train" else argv[1:]
    return " ".join(["specfoundry", "train", *rest])


def make_accelerator(recipe):
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from .launcher import process_group_kwargs
    from .recipe import deepspeed_config_for

    kwargs = {"gradient_accumulation_steps": recipe.training.grad_accum}
    if recipe.tracking.wandb_mode != "disabled":
        kwargs["log_with"] = "wandb"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(**process_group_kwargs())]
    ds = deepspeed_config_for(recipe)
    if ds is not None:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds, zero3_init_flag=False)
    elif recipe.training.precision == "bf16":
        # Accelerate autocasts the method's forward; on CPUs with AVX512-BF16 this measured
        # 1.8x the fp32 step rate of the default EAGLE-3 head (master weights stay fp32)
        kwargs["mixed_precision"] = "bf16"
    elif recipe.training.precision == "fp16" and torch.cuda.is_available():
        kwargs["mixed_precision"] = "fp16"
    return Accelerator(**kwargs)


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def draft_vocabulary(dataset, size: int, vocab_size: int) -> list[int]:
    """The ``size`` most frequent target tokens of the training data (EAGLE-3's reduced vocab);
    ties and unused slots filled by token id so the result is deterministic."""
    counts: Counter = Counter()
    for ex in dataset:
        counts.update(int(t) for t in ex["input_ids"])
    top = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    rest = (t for t in range(vocab_size) if t not in set(top))
    return sorted(top + [next(rest) for _ in range(size - len(top))])


def init_layer_from_target(head, target, layer: int) -> list[str]:
    """Warm-start the head's decoder layer from target layer ``layer``: every parameter of the
    same name and shape is copied; EAGLE-3's 2H-input q/k/v get the target's weights on their
    hidden half (the embedding half keeps its init); ``hidden_norm`` takes the target's input
    norm. Returns the names copied."""
    src = dict(target.model.model.layers[layer].named_parameters())
    H = target.hidden_size
    copied = []
    with torch.no_grad():
        for name, p in head.layer.named_parameters():
            key = "input_layernorm.weight" if name == "hidden_norm.weight" else name
            w = src.get(key)
            if w is None:
                continue
            w = w.detach().to(p.dtype)
            if w.shape == p.shape:
                p.copy_(w)
            elif p.dim() == 2 and p.shape[0] == w.shape[0] and p.shape[1] == 2 * w.shape[1] == 2 * H:
                p[:, H:].copy_(w)  # cat(embed, hidden): the hidden half
            else:
                continue
            copied.append(name)
    return copied


def build_method(recipe, target, train_ds):
    """(speculator module to save, training method module)."""
    from .zero3_target import gathered

    spec = recipe.speculator
    # a zero3-placement target holds only partitions: the modules a speculator copies at init (the
    # final norm, the layer it warm-starts from) are all-gathered for the build (every rank builds
    # the speculator, so every rank enters the collective); a no-op for a whole target
    copied = list(target.final_norm.parameters())
    if getattr(spec, "init_from_target_layer", None) is not None:
        copied += list(target.model.model.layers[spec.init_from_target_layer].parameters())
    with gathered(copied):
        return _build_method(recipe, target, train_ds)


def _build_method(recipe, target, train_ds):
    from specfoundry.runtime.speculators import EagleHead, Eagle3Head, MedusaHeads

    from .methods import DraftKDMethod, Eagle1Method, Eagle3Method, Medusa2Method, MedusaMethod

    spec, tr = recipe.speculator, recipe.training
    layers = recipe.target.feature_layers
    if recipe.method == "eagle3":
        head = Eagle3Head.from_target(target, seed=tr.seed, draft_vocab_size=spec.draft_vocab_size,
                                      **({"feature_layers": layers} if layers else {}))
        head.set_draft_vocab(draft_vocabulary(train_ds, spec.draft_vocab_size, target.vocab_size))
        with torch.no_grad():  # start the reduced LM head from the target's rows
            head.lm_head.weight.copy_(target.lm_head.weight[head.d2t].to(head.lm_head.weight.dtype))
        head = head.float()
        if spec.init_from_target_layer is not None:
            init_layer_from_target(head, target, spec.init_from_target_layer)
        return head, Eagle3Method(head, target.lm_head, ttt_steps=tr.ttt_steps, position_decay=tr.position_weight_decay)
    if recipe.method == "eagle":
        head = EagleHead.from_target(target, seed=tr.seed).float()
        if spec.init_from_target_layer is not None:
            init_layer_from_target(head, target, spec.init_from_target_layer)
        return head, Eagle1Method(head, ce_weight=spec.token_loss_weight / max(spec.feature_loss_weight, 1e-9))
    if recipe.method in ("medusa1", "medusa2"):
        # a reduced vocabulary (speculator.draft_vocab_size): the training data's most frequent tokens
        if (spec.draft_vocab_size or 0) > target.vocab_size:
            raise ValueError(f"speculator.draft_vocab_size {spec.draft_vocab_size} exceeds the target vocabulary "
                             f"{target.vocab_size}")
        vocab = None if spec.draft_vocab_size is None or spec.draft_vocab_size == target.vocab_size else \
            draft_vocabulary(train_ds, spec.draft_vocab_size, target.vocab_size)
        heads = MedusaHeads.from_target(target, seed=tr.seed, num_heads=spec.num_heads, num_layers=spec.num_layers,
                                        draft_token_ids=vocab).float()
    if recipe.method == "medusa1":
        return heads, MedusaMethod(heads, target.lm_head, position_decay=tr.position_weight_decay)
    if recipe.method == "medusa2":
        from .methods.medusa2 import lora_backbone

        return heads, Medusa2Method(lora_backbone(target, spec.lora), heads, target.lm_head,
                                    position_decay=tr.position_weight_decay, heads_loss_weight=spec.heads_loss_weight,
                                    heads_warmup_steps=spec.heads_warmup_steps)
    if recipe.method == "draft":
        from .methods.draft import draft_model_for

        lm = draft_model_for(spec, target)
        return lm, DraftKDMethod(lm.model, target.lm_head, kd_loss=spec.kd_loss, temperature=spec.temperature)
    raise NotImplementedError(f"method {recipe.method!r} is not implemented")


def save_medusa2_backbone(recipe, target, method_state: dict, run_dir: Path):
    """Write the fine-tuned backbone Medusa-2 heads belong to and return it as a TargetModel:
    ``merge: true`` -> ``target/`` (an HF model dir with the LoRA folded in); else ``adapter/``
    (the peft adapter, loaded onto the original target by ``load_target``)."""
    from specfoundry.runtime import load_target

    from .methods.medusa2 import lora_backbone, merged_backbone

    spec = recipe.speculator
    peft_model = lora_backbone(target, spec.lora)
    peft_model.load_state_dict({k.removeprefix("backbone."): v for k, v in method_state.items()
                                if k.startswith("backbone.")})
    if spec.merge:
        out = run_dir / "target"
        merged_backbone(peft_model).to(target.dtype).save_pretrained(out)
    else:
        out = run_dir / "adapter"
        peft_model.save_pretrained(out)
        # where load_target finds the base again (a name it resolves, not a cache path)
        (out / "specfoundry_base.json").write_text(json.dumps({"base": recipe.target.name}))
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(out)
    return load_target(str(out), dtype=target.dtype, device=target.device)


def save_result(recipe, target, module, state_dict, run_dir: Path, training_meta: dict) -> tuple[Path, object]:
    """Write the trained speculator to ``run_dir/speculator``; returns ``(its path, the target it
    belongs to)`` (Medusa-2: the fine-tuned backbone, written beside it)."""
    from specfoundry.runtime.speculators import save_speculator

    if recipe.method == "medusa2":
        target = save_medusa2_backbone(recipe, target, state_dict, run_dir)
    out = run_dir / "speculator"
    if recipe.method == "draft":
        from specfoundry.runtime.atomic import atomic_dir

        from .methods.draft import draft_model_for

        # a fresh draft (as for heads below): under ZeRO-3 the trained one holds only partitions
        fresh = draft_model_for(recipe.speculator, target).model
        fresh.load_state_dict({k.removeprefix("draft."): v for k, v in state_dict.items() if k.startswith("draft.")})
        with atomic_dir(out, lambda p: (p / "specfoundry_target.json").exists(), "a draft model directory") as tmp:
            fresh.eval().save_pretrained(tmp)
            if target.tokenizer is not None:
                target.tokenizer.save_pretrained(tmp)
            (tmp / "specfoundry_target.json").write_text(json.dumps({"target": target.identity(), "speculator_type": "draft"}))
        return out, target
    prefix = "heads." if recipe.method.startswith("medusa") else "head."
    # a fresh module: under ZeRO-3 the trained one holds only this rank's (empty) partitions
    fresh = type(module).build(module.architecture, target)
    fresh.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
    return save_speculator(fresh.to(target.device, target.dtype).eval(), out, target, training=training_meta), target


# what a resume may change: how the run is reported, evaluated and checkpointed, not what it trains
_RESUME_MAY_CHANGE = ("description", "output_dir", "evaluation", "tracking", "launcher", "data.cache_dir",
                      "training.max_minutes", "training.log_every", "training.checkpoint_every",
                      "training.keep_checkpoints")


def _flat(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def check_resume_recipe(recipe, run_dir: Path) -> None:
    """``--resume`` continues the run with the recipe it started with: a changed method, target,
    data or optimisation (a ``--set`` or an edited YAML) would mix two runs in one set of
    weights. ``ValueError`` naming the fields that differ."""
    import tempfile

    import yaml

    from .recipe import dump_resolved

    old_file = run_dir / "recipe.resolved.yaml"
    if not old_file.is_file():
        return
    try:
        old = _flat(yaml.safe_load(old_file.read_text()) or {})
    except (yaml.YAMLError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"--resume: {old_file} is unreadable ({exc}); start a new run with --overwrite") from None
    with tempfile.TemporaryDirectory() as tmp:
        new = _flat(yaml.safe_load(dump_resolved(recipe, Path(tmp)).read_text()) or {})
    differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)
                    and not any(k == p or k.startswith(p + ".") for p in _RESUME_MAY_CHANGE))
    if differ:
        shown = "; ".join(f"{k}: {old.get(k)!r:.40} -> {new.get(k)!r:.40}" for k in differ[:5])
        raise ValueError(f"--resume: the recipe differs from the one {run_dir} was started with ({shown}"
                         + (f"; {len(differ) - 5} more" if len(differ) > 5 else "") + "); resume with "
                         f"{old_file} or start a new run with --overwrite")


def check_evaluation_shape(recipe) -> None:
    """The evaluation's draft shape within the runtime's bounds (``ValueError`` naming the field)."""
    from specfoundry.runtime.adaptive import MAX_DRAFT_DEPTH, check_int
    from specfoundry.runtime.speculators.checkpoint import drafter_option_problems

    ev = recipe.evaluation
    check_int("evaluation.depth", ev.depth, 1, MAX_DRAFT_DEPTH)
    options = {k: getattr(ev, k) for k in ("tree", "total_tokens", "top_k") if getattr(ev, k, None) is not None}
    for key, problem in drafter_option_problems(options):
        raise ValueError(f"evaluation.{key}: {problem}")


def main(argv: list[str] | None = None) -> int:
    from accelerate.utils import set_seed

    from specfoundry.runtime import load_target

    from .data import build_dataset
    from .features import HiddenStateSource, capture_backend, dataset_hash
    from .distill import states_dir
    from .genstates import GenerationStates, state_layers_for
    from .loop import LoopConfig, check_run_dir, claim_run_dir, read_run_id, train_loop
    from .recipe import default_feature_layers, dump_resolved, load_recipe, prompt_source_dicts, resolve
    from .tracking import init_tracking

    ap = argparse.ArgumentParser(prog="specfoundry.train.run")
    ap.add_argument("recipe")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--overwrite", action="store_true", help="clear an existing run directory first")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    recipe = resolve(load_recipe(args.recipe, overrides=args.set or None))
    run_dir = Path(recipe.output_dir)
    # before anything is loaded or written: a run directory belongs to one run, and the draft shape
    # the run ends by measuring is one the runtime accepts (not a failure after hours of training)
    check_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)
    check_evaluation_shape(recipe)
    if args.resume:
        check_resume_recipe(recipe, run_dir)
    # on the recipe's device (cuda: this process's GPU, LOCAL_RANK under a launcher), where the head
    # is trained and the hidden states are consumed
    dev = recipe.target.device
    dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if dev == "cuda" else dev
    from .zero3_target import (is_zero3_placement, load_partitioned_target, load_whole_target, plain_hf_init, release,
                               share_dataset)

    zero3 = is_zero3_placement(recipe)
    if zero3:
        # target.placement zero3 (train/zero3_target.py): the process group first (zero.Init
        # partitions over it); the data phase runs in the main process alone, with the whole target
        # there (nowhere else), and the partitioned target is loaded after it
        acc = make_accelerator(recipe)
        target = load_whole_target(recipe, dev) if acc.is_main_process else None
        if not acc.is_main_process:
            def build_dataset(*_args, **_kwargs):  # noqa: F811 - the main process's dataset, shared below
                return None, None
    else:
        # replicate: the frozen target is loaded whole in every process, before the DeepSpeed plugin
        # exists (only the head is sharded by ZeRO)
        target = load_target(recipe.target.name, device=dev, dtype=_dtype(recipe.target.dtype),
                             revision=recipe.target.revision)
        acc = make_accelerator(recipe)
    set_seed(recipe.training.seed)
    if acc.is_main_process:
        claim_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)
        dump_resolved(recipe, run_dir)
    acc.wait_for_everyone()
    run_id = read_run_id(run_dir) or ""
    mode = init_tracking(acc, recipe.tracking.wandb_project, recipe.tracking.run_name, recipe.to_dict(), run_dir,
                         recipe.tracking.wandb_mode) if recipe.tracking.wandb_mode != "disabled" else "disabled"

    d = recipe.data
    # the offline store of the engine's states reads them from the self-distillation's own forwards
    # (no capture pass over what generation computed) when the answers come from the target itself
    keep_states = (not zero3 and d.hidden_states == "offline" and capture_backend(target, d.capture_batch_size) == "engine"
                   and (_dtype(d.responses.dtype) if d.responses.dtype else target.dtype) == target.dtype)
    feature_layers = gen_layers = ()
    if keep_states:  # (what the head will read: checked against the built head below)
        feature_layers = tuple(recipe.target.feature_layers or default_feature_layers(recipe.method, target.num_layers)
                               or ()) or (target.num_layers,)
        gen_layers = state_layers_for(feature_layers, target.num_layers)
    data_stats: dict = {}  # planned vs done, for the summary's stages block
    t_data = time.perf_counter()
    with acc.main_process_first():  # the main process generates and caches; the others reuse
        train_ds, heldout = build_dataset(prompt_source_dicts(recipe), target, responses_cfg=vars(d.responses) | {},
                                          max_seq_len=d.max_seq_len, eval_prompts=d.eval_prompts,
                                          loss_on_prompt=d.loss_on_prompt, cache_dir=d.cache_dir,
                                          seed=recipe.training.seed,
                                          # only the main process generates within the budget; the
                                          # others then read exactly what it cached
                                          max_minutes=d.max_minutes if acc.is_main_process else 0,
                                          stats=data_stats, state_layers=gen_layers)
    data_seconds = time.perf_counter() - t_data
    if zero3:
        train_ds, heldout = share_dataset(acc, train_ds, heldout)
        if target is not None and not release(target):
            print("[target] warning: the whole target is still referenced after the data phase; its memory stays "
                  "in use during training", file=sys.stderr, flush=True)
        target = load_partitioned_target(recipe, dev)
        part = target.partition
        print(f"[target] rank {part['rank']}/{part['world']}: {part['elements_this_rank']} of "
              f"{part['partitioned_elements']} partitioned target elements ({part['fraction_this_rank']:.3f}), "
              f"{part['whole_copy_elements']} in whole copies (LM head, embedding), "
              f"{part['bytes_this_rank'] / 1e6:.1f} MB of target weights here (the whole target: "
              f"{part['whole_target_bytes'] / 1e6:.1f} MB)", file=sys.stderr, flush=True)

    val_ds = None
    if recipe.training.eval_every:
        # mid-run evaluation needs sequences the head never trains on: the last few examples
        n_val = min(32, max(1, len(train_ds) // 20))
        if len(train_ds) > n_val:
            val_ds, train_ds = train_ds.select(range(len(train_ds) - n_val, len(train_ds))), \
                train_ds.select(range(len(train_ds) - n_val))
    module, method = build_method(recipe, target, train_ds)
    layers = tuple(getattr(module, "feature_layers", ()) or ()) or (target.num_layers,)
    keep_states = keep_states and layers == feature_layers  # (else the store captures them all)

    def features_dir(ds) -> Path:
        # one store per dataset: a rerun that generated more data (or split off validation
        # sequences) gets its own, instead of a stale store being refused; and one per capture
        # backend (a store of the other one stays where it is, unused)
        engine = capture_backend(target, d.capture_batch_size) == "engine"
        return Path(d.cache_dir) / "features" / (dataset_hash(ds) + ("-engine" if engine else "")
                                                 + ("-gen" if keep_states else ""))

    def hidden_states(ds) -> HiddenStateSource:
        states = GenerationStates(states_dir(d.cache_dir, target, vars(d.responses) | {}, recipe.training.seed,
                                             gen_layers), layers, target.num_layers) if keep_states else None
        return HiddenStateSource(d.hidden_states, target, layers, cache_dir=features_dir(ds),
                                 capture_batch_size=d.capture_batch_size, states=states)

    source = hidden_states(train_ds)
    with acc.main_process_first():
        source.prepare(train_ds)
        if source.states is not None and source.states.found:
            acc.print(f"[capture] {source.states.found} of {len(train_ds)} sequences' hidden states came from the "
                      f"self-distillation's forwards, {len(train_ds) - source.states.found} captured")
        if val_ds is not None:
            val_source = hidden_states(val_ds)
            val_source.prepare(val_ds, progress=False)
    # (0 when the stores were complete from an earlier run: nothing was read or captured now)
    from_generation = source.states.found + (val_source.states.found if val_ds is not None else 0) \
        if keep_states else None
    tr = recipe.training
    P, rank = acc.num_processes, acc.process_index
    # every process walks the same batch order and takes every P-th batch; the tail that cannot
    # be split evenly is dropped so all ranks run the same number of steps (collectives match)
    per_epoch = max(1, math.ceil(len(train_ds) / tr.batch_size) // P)
    steps = tr.max_steps or math.ceil(per_epoch * (tr.epochs or 1) / tr.grad_accum)
    if tr.max_steps and tr.epochs:
        steps = min(steps, math.ceil(per_epoch * tr.epochs / tr.grad_accum))
    cfg = LoopConfig(max_steps=steps, max_minutes=tr.max_minutes, learning_rate=tr.learning_rate,
                     weight_decay=tr.weight_decay, warmup_steps=tr.warmup_steps, scheduler=tr.scheduler,
                     grad_clip=tr.grad_clip, log_every=tr.log_every, checkpoint_every=tr.checkpoint_every,
                     micro_batch_size=tr.batch_size, eval_every=tr.eval_every)

    def batches(epoch: int, start: int):
        # this rank's batches only (every P-th of the shared order), and exactly per_epoch of them,
        # stopping before the next is computed: a zero3-placement target's forward is a collective
        # (it all-gathers each layer), so every rank must run the same number of target forwards,
        # with none for a batch another rank trains on (that rank is in the head's collectives then)
        it = source.batches(train_ds, tr.batch_size, seed=tr.seed, epoch=epoch, start_step=start, rank=rank,
                            world_size=P)
        yield from itertools.islice(it, max(0, per_epoch - start))

    acc.print(f"[train] {len(train_ds)} sequences, {steps} steps of {tr.batch_size} x {acc.num_processes} process(es)")
    def evaluate(m) -> dict:
        """Token-weighted mean of the method's metrics over the held-out sequences."""
        sums, weight = {}, 0
        for batch in val_source.batches(val_ds, tr.batch_size, seed=0, epoch=0, shuffle=False):
            _, metrics = m(batch)
            w = int(batch["attention_mask"].sum())
            weight += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
        return {k: v / max(weight, 1) for k, v in sums.items()}

    summary = train_loop(acc, method, batches, cfg, run_dir, resume=args.resume, run_id=run_id,
                         evaluate=evaluate if val_ds is not None else None)
    state_dict = summary.pop("state_dict")
    partition = None
    if zero3:
        from accelerate.utils import gather_object

        partition = gather_object([target.partition])  # every rank's share, for the summary
        # saving and the final evaluation run in the main process alone: the whole target there
        if not release(target):
            print("[target] warning: the partitioned target is still referenced after training; its memory stays "
                  "in use", file=sys.stderr, flush=True)
        target = load_whole_target(recipe, dev) if acc.is_main_process else None
    result = {"recipe": recipe.name, "command": _command_line(sys.argv),
              "sequences": len(train_ds), "tokens_trained": summary["tokens"], "steps": summary["global_step"],
              "train_seconds": summary["seconds"], "data_seconds": data_seconds, "wandb_mode": mode,
              "final_metrics": summary["history"][-1] if summary["history"] else {}}
    result["target_placement"] = {"placement": "zero3" if zero3 else "replicate",
                                  **({"ranks": partition} if partition is not None else {})}
    from .stages import capture_stage, data_stage, training_stage

    result["stages"] = {"data": data_stage(data_stats, d.max_minutes),
                        "capture": capture_stage(d.hidden_states, len(train_ds) + (len(val_ds) if val_ds else 0),
                                                 from_generation),
                        "training": training_stage(steps, summary, tr.max_minutes)}
    if acc.is_main_process:
        with plain_hf_init():
            heldout_batches = None if val_ds is None else \
                (lambda: val_source.batches(val_ds, tr.batch_size, seed=0, epoch=0, shuffle=False))
            _save_and_evaluate(recipe, target, module, state_dict, run_dir, summary, heldout, result, acc, t0,
                               heldout_batches)
    # the other ranks wait for the main one's save and evaluation: a rank that exits while its
    # peers still hold the gloo group can abort ("terminate called without an active exception")
    acc.wait_for_everyone()
    acc.end_training()
    return 0


def fit_tree(spec_dir: Path, target, batches) -> dict:
    """A Medusa checkpoint's static tree fitted to its heads on held-out ``batches`` (features as
    in training): the paths most often right (``runtime.speculators.fit_medusa_choices``), stored
    as the checkpoint's ``training.drafter_options.choices``. Returns what was measured."""
    from collections import Counter

    from specfoundry.runtime.speculators import default_medusa_choices, fit_medusa_choices, load_speculator, tree_accepted
    from specfoundry.runtime.speculators.checkpoint import set_drafter_options

    from .methods import MedusaMethod

    heads = load_speculator(spec_dir, target)
    method = MedusaMethod(heads, target.lm_head).eval()
    counts, positions = Counter(), 0
    for batch in batches:
        c, n = method.path_counts(batch)
        counts.update(c)
        positions += n
    fitted = fit_medusa_choices(counts, heads.num_heads)
    set_drafter_options(spec_dir, {"choices": fitted})
    default = default_medusa_choices(heads.num_heads, len(fitted))
    return {"choices": fitted, "nodes": len(fitted), "positions": positions,
            "expected_tau": {name: round(1 + tree_accepted(c, counts, positions), 4)
                             for name, c in (("fitted", fitted), ("default", default))}}


def _save_and_evaluate(recipe, target, module, state_dict, run_dir: Path, summary: dict, heldout, result: dict, acc,
                       t_start: float, heldout_batches=None):
    """Main process: write the speculator (with its fitted Medusa tree, ``heldout_batches``: a
    callable giving the held-out feature batches), measure tau on the evaluation sets, write
    train_summary.json."""
    from specfoundry.runtime import load_drafter

    from .evaluate import BUILTIN_HELDOUT, evaluate_speculator
    from .prompts import read_prompt_file

    ev = recipe.evaluation
    options = {k: getattr(ev, k) for k in ("tree", "total_tokens", "top_k") if getattr(ev, k) is not None}
    meta = {"recipe": recipe.name, "steps": summary["global_step"], "tokens": summary["tokens"]}
    if recipe.method in ("eagle3", "eagle") and options:
        meta["drafter_options"] = {**options, "depth": ev.depth}  # load_drafter's default shape
    choices = getattr(recipe.speculator, "choices", None)
    if recipe.method in ("medusa1", "medusa2") and isinstance(choices, list):
        meta["drafter_options"] = {"choices": choices}  # the recipe's tree: the heads' default
    spec_dir, target = save_result(recipe, target, module, state_dict, run_dir, meta)
    if choices == "fit" and heldout_batches is not None:
        result["tree"] = fit_tree(spec_dir, target, heldout_batches())
        t = result["tree"]
        acc.print(f"[eval] medusa tree fitted on {t['positions']} held-out positions: {t['nodes']} nodes, expected "
                  f"tau {t['expected_tau']['fitted']:.2f} (the default tree: {t['expected_tau']['default']:.2f})")
    elif choices == "fit":  # too few sequences to split any off: said, not hidden
        result["tree"] = {"choices": "default", "why": "no held-out sequences to fit the tree on"}
        acc.print("[eval] medusa tree NOT fitted (no held-out sequences): the heads keep the default tree")
    sets, skipped = {}, {}
    for name in ev.prompt_sets:
        if name == BUILTIN_HELDOUT:
            sets[name] = heldout[: ev.limit]
        elif not Path(name).exists():  # e.g. ../shared/data beside a clone: measured where present
            skipped[name] = "file not found"
            acc.print(f"[eval] skipping {name}: file not found")
        else:  # a fixed random sample, so a category-ordered file (MT-bench) is not one category
            sets[name] = read_prompt_file(name, ev.limit, shuffle=True, seed=0)
    # tau at T > 0 on the recipe's tree, as before the runtime's sampling requests drafted chains
    # (sampled_trees=False, the runtime default: cheaper where the tree is drafted in Python)
    sampled = {"sampled_trees": True} if recipe.method in ("eagle3", "eagle") else {}
    drafter = load_drafter(str(spec_dir), target=target, **options, **sampled)
    result["measured"] = evaluate_speculator(target, drafter, sets, temperatures=ev.temperatures,
                                             max_new_tokens=ev.max_new_tokens, depth=ev.depth,
                                             baseline=ev.baseline, max_minutes=ev.max_minutes,
                                             adaptive=ev.adaptive)
    result["evaluation"] = {"depth": ev.depth, "adaptive": ev.adaptive, **options, **sampled,
                            **({"skipped": skipped} if skipped else {})}
    if recipe.method in ("eagle3", "eagle") and ev.runtime_prompts and ev.runtime_shapes and heldout:
        # the measured choice becomes the checkpoint's runtime default (runtime/tune.py: the first
        # candidate unless another is clearly faster)
        from specfoundry.runtime.speculators.checkpoint import set_runtime_shape
        from specfoundry.runtime.tune import measure_runtime_shape, shape_label

        shape = measure_runtime_shape(target, spec_dir, heldout[: ev.runtime_prompts], ev.runtime_shapes,
                                      max_new_tokens=ev.max_new_tokens, max_minutes=ev.runtime_max_minutes)
        set_runtime_shape(spec_dir, shape)
        result["runtime_shape"] = shape
        acc.print("[eval] runtime shape: " + ", ".join(f"{c} {v:.2f}x" for c, v in shape["speedups"].items())
                  + f" -> {shape_label(shape)} "
                  f"(prompt lookup first, {shape['prompts']} held-out prompts)")
    if recipe.method in ("eagle3", "eagle") and ev.runtime_prompts and ev.draft_temperatures and heldout:
        # the scale of a sampling request's temperature its drafts are drawn at (runtime/calibrate.py)
        from specfoundry.runtime.calibrate import measure_draft_temperature
        from specfoundry.runtime.speculators.checkpoint import set_draft_temperature

        measured = measure_draft_temperature(target, load_drafter(str(spec_dir), target=target),
                                             heldout[: ev.runtime_prompts], ev.draft_temperatures,
                                             max_new_tokens=ev.max_new_tokens)
        set_draft_temperature(spec_dir, measured)
        result["draft_temperature"] = measured
        scale, by_scale = measured["scale"], measured["acceptance"]
        acc.print(f"[eval] draft temperature: {scale:g} x the request's (first-draft acceptance {by_scale[f'{scale:g}']:.3f}, "
                  f"at 1 x {by_scale.get('1', float('nan')):.3f}; {measured['positions']} held-out positions)")
    from .stages import evaluation_stage, guard_line

    # planned = the prompts the recipe asked for per set (a set with fewer is marked, not hidden)
    result.setdefault("stages", {})["evaluation"] = evaluation_stage(
        result["measured"], {name: ev.limit for name in sets}, ev.max_minutes)
    result["guard_report"] = guard_line(result["stages"])
    result["predicted_tau"] = result["final_metrics"].get("predicted_tau")
    result["wall_seconds"] = time.perf_counter() - t_start
    (run_dir / "train_summary.json").write_text(json.dumps(result, indent=2, default=str))
    acc.log({f"measured/{s}/{t}/tau": v["tau"] for s, per in result["measured"].items() for t, v in per.items()
             if v["tau"] is not None},
            step=summary["global_step"])
    print(json.dumps({k: result[k] for k in ("recipe", "tokens_trained", "wall_seconds", "predicted_tau", "measured",
                                             "runtime_shape", "guard_report") if k in result},
                     indent=2, default=str))


def _cli() -> int:
    """``accelerate launch -m specfoundry.train.run``: one sentence for a refused or stopped run."""
    from .loop import NonFiniteError

    try:
        return main()
    except (ValueError, FileNotFoundError, NonFiniteError) as exc:
        print(f"specfoundry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_cli())
