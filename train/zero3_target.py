"""The frozen target partitioned over the processes by DeepSpeed ZeRO-3 (``target.placement: zero3``).

Scope: what ``train/run.py`` does with the target in a run whose plan says ``zero3`` placement
(ZeRO stage 3, more than one process):

- the **training phase** (online hidden states inside every step, mid-run evaluation) holds the
  target partitioned: :func:`load_partitioned_target` loads it under ``deepspeed.zero.Init``
  (transformers' ``HfDeepSpeedConfig`` set for the load only), so ``from_pretrained`` materialises
  only this rank's 1/N of every parameter, and wraps its decoder (``model.model``, the module the
  hidden-state source calls) in a DeepSpeed engine without an optimizer (ZeRO-3 inference:
  ``DeepSpeedZeRoOffload``), whose hooks all-gather each layer's parameters just before that layer
  runs and free them after. Every rank runs the same number of target forwards (the batch split
  guarantees it), which the all-gathers need.
- the LM head (and the input embedding, for the speculator's use) are also kept **whole** in every
  process: the head reads them every step (EAGLE-3's target distribution, the head's token
  embedding), outside any engine's hooks. The embedding inside the target's forward stays
  partitioned and is gathered by the hooks like a layer.
- the target's identity (the weights fingerprint a speculator checkpoint records) is computed
  over the gathered parameters, one at a time: it equals a whole load's (tests check it).
- **data generation, offline capture, saving and the final evaluation** run in the main process
  alone and need the whole target there: :func:`load_whole_target` loads it (spread over the
  machine's GPUs with ``device_map="auto"`` when it has several) for those phases only, and it is
  freed before the partitioned one is loaded. Offline hidden states are refused with zero3
  placement by the recipe checks (the capture pass would hold the whole target anyway), as are
  Medusa-2 (the backbone trains) and a draft built from target layers (copied from partitions).
"""

from __future__ import annotations

import contextlib
import gc

import torch

from specfoundry.runtime.target import TargetModel

__all__ = ["is_zero3_placement", "target_deepspeed_config", "PartitionedTarget", "load_partitioned_target",
           "load_whole_target", "release", "gathered", "partition_stats", "share_dataset"]


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def plain_hf_init():
    """Build and load HF models as ordinary modules even when a ZeRO-3 run is active: transformers
    would otherwise wrap their construction in ``deepspeed.zero.Init``, a collective that only the
    main process (saving, evaluating) would enter, and hang there."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def is_zero3_placement(recipe) -> bool:
    """True when the run partitions the frozen target (resolved placement ``zero3``, ZeRO stage 3,
    more than one process) -- the plan's own rule (:func:`specfoundry.train.plan._placement`)."""
    from .launcher import process_counts, zero_stage

    return recipe.target.placement == "zero3" and zero_stage(recipe) == 3 and process_counts(recipe)[0] > 1


def target_deepspeed_config(recipe) -> dict:
    """The DeepSpeed config of the frozen target's engine: the recipe's ZeRO-3 section (bucket and
    persistence sizes filled from the recipe; parameter offload kept, optimizer offload dropped:
    there is no optimizer), the precision of the *target's* dtype (zero.Init builds the weights in
    it), batch sizes of 1 (never used: the engine only runs forwards)."""
    from .launcher import deepspeed_config_for

    full = deepspeed_config_for(recipe) or {}
    zo = {k: v for k, v in full.get("zero_optimization", {}).items() if k != "offload_optimizer"}
    zo["stage"] = 3
    dt = recipe.target.dtype
    return {"zero_optimization": zo, "bf16": {"enabled": dt == "bf16"}, "fp16": {"enabled": dt == "fp16"},
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _is_partitioned(p) -> bool:
    return hasattr(p, "ds_id")


@contextlib.contextmanager
def gathered(params):
    """All-gather these ZeRO-3 parameters for the block (a collective: every rank must enter it);
    a no-op for ordinary parameters."""
    params = [p for p in params if _is_partitioned(p)]
    if not params:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params):
        yield


class _GatheredNamedParameters:
    """Stands in for the HF model inside :meth:`TargetModel.fingerprint`: ``named_parameters()``
    yields each parameter gathered whole while the caller's loop body looks at it."""

    def __init__(self, model):
        self._model = model

    def named_parameters(self):
        for name, p in self._model.named_parameters():
            with gathered([p]):
                yield name, p


class PartitionedTarget(TargetModel):
    """A :class:`TargetModel` whose decoder holds only this rank's ZeRO-3 partitions.

    ``embed_tokens`` / ``lm_head`` are whole copies (``lm_head`` is also what the HF model's
    forward uses now); ``fingerprint()`` was computed over the gathered weights at load."""

    def __init__(self, model, tokenizer, name, *, engine, embed, fingerprint: str, stats: dict):
        super().__init__(model, tokenizer, name=name)
        self.engine = engine
        self._embed = embed
        self._fingerprint = fingerprint
        self.partition = stats

    @property
    def device(self) -> torch.device:
        return self._embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self._embed.weight.dtype

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self._embed

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]


def partition_stats(model, world: int, rank: int) -> dict:
    """Elements this rank holds of the target's partitioned parameters (``ds_tensor``), of all of
    them (``ds_numel``), and of the whole copies kept beside them."""
    held = total = whole = 0
    nbytes = whole_target = 0
    for p in model.parameters():
        if _is_partitioned(p):
            held += p.ds_tensor.numel()
            total += p.ds_numel
            nbytes += p.ds_tensor.numel() * p.ds_tensor.element_size()
            whole_target += p.ds_numel * p.ds_tensor.element_size()
        else:
            whole += p.numel()
            nbytes += p.numel() * p.element_size()
            whole_target += p.numel() * p.element_size()
    return {"world": world, "rank": rank, "partitioned_elements": total, "elements_this_rank": held,
            "fraction_this_rank": held / max(total, 1), "whole_copy_elements": whole, "bytes_this_rank": nbytes,
            "whole_target_bytes": whole_target}


def load_partitioned_target(recipe, device: str) -> PartitionedTarget:
    """Load ``recipe.target`` partitioned over the processes (see the module docstring). A
    collective: every rank calls it, after the process group exists (the accelerator is made)."""
    import deepspeed
    import torch.distributed as dist
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_ds

    from specfoundry.runtime import load_target

    if not deepspeed.comm.is_initialized():  # DeepSpeed's view of the process group accelerate made
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    cfg = target_deepspeed_config(recipe)
    dtype = _DTYPES[recipe.target.dtype]
    prev = hf_ds._hf_deepspeed_config_weak_ref
    dschf = HfDeepSpeedConfig(cfg)  # transformers builds and loads under deepspeed.zero.Init while it lives
    try:
        # the HF path (no engine): the runtime engine's kernel choice reads weights, which are empty here
        base = load_target(recipe.target.name, device=device, dtype=dtype, revision=recipe.target.revision,
                           backend="hf")
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = prev
        del dschf
    model = base.model
    if not any(_is_partitioned(p) for p in model.parameters()):
        raise RuntimeError("target.placement zero3: the target was loaded whole (deepspeed.zero.Init did not apply)")
    # the identity a whole load gives: same parameter names, shapes and sampled values
    emb, lm = model.get_input_embeddings(), model.get_output_embeddings()
    whole_embed = _whole_embedding(emb)
    fingerprint = _gathered_fingerprint(model, whole_embed)
    # whole copies for the speculator's every step; the HF model's LM head becomes the whole one
    # (nothing else calls the partitioned original, which is then freed)
    whole_lm = _whole_linear(lm) if lm.weight is not emb.weight else None
    if whole_lm is None:  # tied: one matrix serves both
        whole_lm = torch.nn.Linear(whole_embed.embedding_dim, whole_embed.num_embeddings, bias=False,
                                   device=whole_embed.weight.device, dtype=whole_embed.weight.dtype)
        whole_lm.weight = whole_embed.weight
    engine, *_ = deepspeed.initialize(model=model.model, config=cfg)
    model.lm_head = whole_lm.requires_grad_(False)
    model.model.eval()
    world, rank = dist.get_world_size(), dist.get_rank()
    stats = partition_stats(model, world, rank)
    if whole_lm.weight is not whole_embed.weight:  # the embedding copy lives beside the model, not in it
        stats["whole_copy_elements"] += whole_embed.weight.numel()
        stats["bytes_this_rank"] += whole_embed.weight.numel() * whole_embed.weight.element_size()
    return PartitionedTarget(model, base.tokenizer, base.name, engine=engine, embed=whole_embed.requires_grad_(False),
                             fingerprint=fingerprint, stats=stats)


def _whole_embedding(emb) -> torch.nn.Embedding:
    with gathered([emb.weight]), torch.no_grad():
        w = emb.weight.detach().clone()
    out = torch.nn.Embedding(w.shape[0], w.shape[1], padding_idx=emb.padding_idx, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
    return out


def _whole_linear(lin) -> torch.nn.Linear:
    params = [lin.weight] + ([lin.bias] if lin.bias is not None else [])
    with gathered(params), torch.no_grad():
        w = lin.weight.detach().clone()
        b = lin.bias.detach().clone() if lin.bias is not None else None
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if b is not None:
            out.bias.copy_(b)
    return out


def _gathered_fingerprint(model, embed) -> str:
    """:meth:`TargetModel.fingerprint` (the runtime's own code) over the parameters gathered one at
    a time, with ``embed`` (whole) as the embedding whose rows it samples."""

    class _Probe(TargetModel):
        embed_tokens = property(lambda self: embed)

    probe = _Probe.__new__(_Probe)
    probe.model, probe._fingerprint = _GatheredNamedParameters(model), None
    return probe.fingerprint()


def release(target) -> bool:
    """Free a target this module loaded (partitioned: the engine's hooks removed, the partitions
    dropped; whole: its HF model dropped). Returns whether the HF model (and a partition) are gone
    after a garbage collection (False: something still references them, their memory stays in use)."""
    import weakref

    model = getattr(target, "model", None)
    if model is None:
        return True
    gone = weakref.ref(model)
    part = next((p.ds_tensor for p in model.parameters() if _is_partitioned(p)), None)
    part_gone = weakref.ref(part) if part is not None else None
    del part
    engine = getattr(target, "engine", None)
    if engine is not None:
        with contextlib.suppress(Exception):  # best effort: the memory is what matters
            engine.destroy()
        target.engine = None
        # DeepSpeed appends an engine's top module to this global stack at setup and never takes it
        # off: left there it keeps the whole partitioned model (and its partitions) alive
        from deepspeed.runtime.zero import parameter_offload

        stack = parameter_offload.FWD_MODULE_STACK
        stack[:] = [m for m in stack if m is not getattr(model, "model", None)]
        # and a class-level functools.lru_cache on the coordinator's __params_to_release keeps every
        # (coordinator, submodule) it saw: cleared (a cache: other engines just recompute it)
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

        fn = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
        for _ in range(3):  # under DeepSpeed's instrument_w_nvtx wrapper (a closure, no __wrapped__)
            if fn is None or hasattr(fn, "cache_clear"):
                break
            inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
            fn = getattr(fn, "__wrapped__", None) or (inner[0] if inner else None)
        if fn is not None and hasattr(fn, "cache_clear"):
            fn.cache_clear()
    target.model = None
    del model, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return gone() is None and (part_gone is None or part_gone() is None)


def load_whole_target(recipe, device: str):
    """The whole target in this (the main) process, for the phases that run there alone (data
    generation, saving, the final evaluation) in a zero3-placement run: spread over the machine's
    GPUs with ``device_map="auto"`` when ``device`` is CUDA and there are several (a 70B target
    fits 8 x 80 GB, not one), else on ``device`` as the replicate path loads it."""
    from specfoundry.runtime import load_target

    dtype = _DTYPES[recipe.target.dtype]
    with plain_hf_init():
        if str(device).startswith("cuda") and torch.cuda.device_count() > 1:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from specfoundry.runtime.models import resolve_target_path, wrap_target

            path, display = resolve_target_path(recipe.target.name, recipe.target.revision)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                         use_safetensors=True, device_map="auto")
            tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
            return wrap_target(model, tok, name=display, backend="hf")
        return load_target(recipe.target.name, device=device, dtype=dtype, revision=recipe.target.revision)


def share_dataset(acc, train_ds, heldout):
    """``(train_ds, heldout)`` in every process from the main process's: it built the dataset
    (with the whole target) and saved it; the others memory-map the same directory (one machine
    or a shared filesystem, as the data cache already assumes for the replicate path)."""
    from accelerate.utils import broadcast_object_list
    from datasets import load_from_disk

    where = None
    if acc.is_main_process:
        files = train_ds.cache_files
        if not files:
            raise RuntimeError("target.placement zero3: the training dataset is not saved on disk, so the other "
                               "processes cannot read it")
        from pathlib import Path

        where = str(Path(files[0]["filename"]).parent)
    obj = [where, heldout if acc.is_main_process else None]
    broadcast_object_list(obj, from_process=0)
    where, heldout = obj
    if not acc.is_main_process:
        train_ds = load_from_disk(where)
    return train_ds, heldout
