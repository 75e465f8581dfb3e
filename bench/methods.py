"""Benchmark methods: our decoding (plain and every drafter in fixed and adaptive shapes) and
in-process peers (HF transformers ``generate``: plain, prompt lookup, assisted with a draft).

A method spec is ``SOURCE[:SHAPE][@DEPTH[/NODES]]``:

- ``plain``: our plain decoding (``speculate=False``), the reference of every ratio;
- ``plain-hf``: the same on the HF ``DynamicCache`` path instead of the engine (same weights);
- ``ngram`` / ``draft``: shapes ``chain`` (default) and ``adaptive``;
- ``medusa``: ``static`` (its static tree, default), ``chain``, ``adaptive``;
- ``eagle`` / ``eagle3``: ``dynamic`` (EAGLE-2 tree, default; ``@K/N`` fixes its depth and node
  count, root included, as the runtime-shape candidate ``tree@K/N``), ``chain``, ``adaptive``;
- ``lookup`` (every model drafter): its chain of ``@DEPTH``, with prompt lookup first (a
  continuation of at most 5 tokens whenever the context's last >= 2 tokens occurred before:
  :class:`~specfoundry.runtime.drafters.lookup.LookupFirstDrafter`); ``lookup-adaptive``: the
  same lookup before the ``adaptive`` shape (the controller drives the model drafter's steps);
  ``lookup-tree@K/N`` (EAGLE heads): the same lookup before a fixed tree of depth ``K``, ``N`` nodes
  (at T > 0 the EAGLE heads draft a chain of depth ``K`` instead: their ``sampled_trees`` default);
- ``runtime`` (trained EAGLE heads): what ``generate`` and ``serve`` load by default, prompt lookup first before
  the run's measured runtime shape (``training.runtime_shape``, else its tau shape under the controller),
  named as the spec it resolves to (e.g. ``eagle3:lookup-tree@2/4``);
- peers: ``hf``, ``hf-lookup[@K]``, ``hf-assisted``; out-of-process peers (``vllm``,
  ``vllm-eagle3[@K]``, ``llamacpp``, ``llamacpp-lookup[@K]``) live in :mod:`specfoundry.bench.external`.

Fixed shapes run with the adaptive controller off (the draft shape is exactly the one named);
``adaptive`` is the drafter's natural shape with the controller on. ``draft``/``medusa``/
``eagle``/``eagle3`` come from run directories (``runs/<recipe>/speculator``); without a run,
``draft`` is an *untrained layer-subset draft* and the heads are random-init (labelled so).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specfoundry.runtime import SpeculativeGenerator, load_drafter
from specfoundry.runtime.adaptive import AcceptanceTally, parse_shape_candidate, tree_options
from specfoundry.runtime.drafters.base import Drafter
from specfoundry.runtime.drafters.draft import DraftModelDrafter, layer_subset_model
from specfoundry.runtime.drafters.lookup import LookupFirstDrafter
from specfoundry.runtime.target import TargetModel
from specfoundry.runtime.tree import tree_layout

_LOOKUP = ("lookup", "lookup-adaptive")
_EAGLE_SHAPES = ("dynamic", "chain", "adaptive") + _LOOKUP + ("lookup-tree", "runtime")
SHAPES = {"ngram": ("chain", "adaptive"), "draft": ("chain", "adaptive") + _LOOKUP,
          "medusa": ("static", "chain", "adaptive") + _LOOKUP, "eagle": _EAGLE_SHAPES, "eagle3": _EAGLE_SHAPES}
_NODE_SHAPES = ("dynamic", "lookup-tree")  # shapes that take @K/N
HF_PEERS = ("hf", "hf-lookup", "hf-assisted")
EXTERNAL_PEERS = ("vllm", "vllm-eagle3", "llamacpp", "llamacpp-lookup")
_SPEC = re.compile(r"^(?P<src>[A-Za-z0-9_.\-]+?)(?::(?P<shape>[a-z][a-z\-]*))?(?:@(?P<depth>\d+)(?:/(?P<nodes>\d+))?)?$")


@dataclass
class RunResult:
    token_ids: list[int]
    seconds: float  # wall clock of the whole call (prefill included)
    stats: dict | None = None  # speculation figures where the method has them


@dataclass
class Method:
    """One benchmarked method. ``runner(prompt_ids, max_new_tokens, temperature, seed,
    stop_at_eos) -> RunResult``; ``check``: ``"strict"`` (T=0 output must equal ``reference``'s
    greedy output, near-ties aside), ``"info"`` (other weights/kernels: the rate is reported,
    a divergence is not a failure) or ``"exact"`` (as info, with no near-tie judgement: the
    reference ran other weights than our target, e.g. a GGUF)."""

    name: str
    label: str
    kind: str  # "plain" | "ours" | "peer"
    runner: Callable[..., RunResult] | None = None
    draft_depth: int | None = None
    interleaved: bool = True
    check: str = "strict"
    reference: str = "plain"
    note: str = ""
    batch_runner: Callable[..., list[RunResult]] | None = field(default=None, repr=False)

    def describe(self) -> dict:
        return {"name": self.name, "label": self.label, "kind": self.kind, "draft_depth": self.draft_depth,
                "interleaved": self.interleaved, "check": self.check, "reference": self.reference, "note": self.note}


class RecordingDrafter(Drafter):
    """Wraps a drafter and counts, per draft depth d, the steps that drafted depth d with depth
    d-1 accepted (``tried``) and those that accepted depth d (``passed``): exact pooled
    acceptance, the same definition as the runtime's ``acceptance_by_position``."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.type = inner.type
        self.feature_layers = inner.feature_layers
        self.default_depth = inner.default_depth
        self.default_nodes = inner.default_nodes
        self.default_adaptive = inner.default_adaptive
        if hasattr(inner, "pre_draft"):  # the generator's optional hook, recorded like propose
            self.pre_draft = self._pre_draft
        self.reset()

    def reset(self) -> None:
        self.tally = AcceptanceTally(0)
        self._depth = 0
        self._deepest = 0  # deepest depth drafted: the length of tried/passed

    @property
    def tried(self) -> list[int]:
        return self.tally.tried[1:self._deepest + 1]

    @property
    def passed(self) -> list[int]:
        return self.tally.passed[1:self._deepest + 1]

    def begin(self, prompt_ids, features) -> None:
        self._depth = 0
        self.inner.begin(prompt_ids, features)

    def propose(self, ctx):
        return self._seen(self.inner.propose(ctx))

    def _seen(self, draft):
        if draft is not None:  # (host lists and the per-shape layout: no tensor op in the timed loop)
            self._depth = tree_layout(draft.lists()[1], draft.tokens.device).max_depth
        return draft

    def _pre_draft(self, tokens, max_depth, root_id=None):
        return self._seen(self.inner.pre_draft(tokens, max_depth, root_id))

    def commit(self, new_tokens, features) -> None:
        self.tally.record(self._depth, int(new_tokens.shape[1]) - 1)
        self._deepest = max(self._deepest, self._depth)
        self._depth = 0
        self.inner.commit(new_tokens, features)


def generator_runner(gen: SpeculativeGenerator, speculate: bool = True) -> Callable[..., RunResult]:
    """A runner around our generator (timed around the whole ``generate`` call)."""
    recorder = gen.drafter if isinstance(gen.drafter, RecordingDrafter) else None

    def run(prompt_ids, max_new_tokens, temperature, seed, stop_at_eos) -> RunResult:
        if recorder is not None:
            recorder.reset()
        t0 = time.perf_counter()
        out = gen.generate(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                           speculate=speculate, stop_at_eos=stop_at_eos)
        seconds = time.perf_counter() - t0
        stats = out.stats.as_dict()
        if recorder is not None:
            stats["tried"], stats["passed"] = list(recorder.tried), list(recorder.passed)
        return RunResult(list(out.token_ids), seconds, stats)

    return run


def hf_runner(target: TargetModel, **extra) -> Callable[..., RunResult]:
    """HF ``generate`` on the target's own model: an explicit ``GenerationConfig`` (no
    top-k/top-p defaults from the model) so sampling targets the same distribution as ours."""
    from transformers import GenerationConfig

    model = target.model

    def run(prompt_ids, max_new_tokens, temperature, seed, stop_at_eos) -> RunResult:
        eos = sorted(target.eos_token_ids) if stop_at_eos else []
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {"do_sample": False}
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                               **sampling, **{k: v for k, v in extra.items() if k != "assistant_model"})
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
        kw = {"assistant_model": extra["assistant_model"]} if "assistant_model" in extra else {}
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kw)
        seconds = time.perf_counter() - t0
        return RunResult(out[0, ids.shape[1]:].tolist(), seconds, None)

    return run


def parse_spec(spec: str) -> tuple[str, str | None, int | None, int | None]:
    """``SOURCE[:SHAPE][@DEPTH[/NODES]]`` -> (source, shape, depth, nodes); nodes only for tree shapes."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"bad method spec {spec!r}: expected SOURCE[:SHAPE][@DEPTH[/NODES]], e.g. eagle3:chain@4")
    depth = int(m["depth"]) if m["depth"] else None
    if depth is not None and depth < 1:
        raise ValueError(f"bad method spec {spec!r}: the draft depth must be >= 1")
    nodes = None
    if m["nodes"]:
        if m["shape"] not in _NODE_SHAPES:
            raise ValueError(f"bad method spec {spec!r}: @K/N is for the tree shapes {list(_NODE_SHAPES)}")
        try:
            parse_shape_candidate(f"tree@{depth}/{m['nodes']}")
        except ValueError as exc:
            raise ValueError(f"bad method spec {spec!r}: {exc}") from None
        nodes = int(m["nodes"])
    elif m["shape"] == "lookup-tree":
        raise ValueError(f"bad method spec {spec!r}: lookup-tree needs @K/N (depth and nodes), e.g. lookup-tree@2/4")
    return m["src"], m["shape"], depth, nodes


@dataclass
class Source:
    """Where a drafter type comes from: a run's speculator directory, or nothing (untrained)."""

    type: str
    path: Path | None = None
    run: str | None = None

    @property
    def trained(self) -> bool:
        return self.path is not None

    def describe(self) -> str:
        if self.path is not None:
            return f"from {self.run or self.path}"
        if self.type == "draft":
            return "untrained layer-subset draft"
        return "untrained random-init head" if self.type != "ngram" else "prompt lookup"


def source_from_run(run: str | Path) -> Source:
    """``runs/<recipe>`` (or its ``speculator/``, or any checkpoint / HF draft directory)."""
    p = Path(run).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"run directory {p} does not exist")
    spec = p / "speculator" if (p / "speculator").is_dir() else p
    cfg_file = spec / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{p}: no speculator/config.json (expected runs/<recipe>/speculator from a training run)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file}: not valid JSON ({exc.msg})") from None
    kind = cfg.get("speculator_type", "draft") if isinstance(cfg, dict) else "draft"
    if kind not in SHAPES:
        raise ValueError(f"{cfg_file}: unknown speculator_type {kind!r}; expected one of {sorted(SHAPES)}")
    name = p.name if p.name != "speculator" else p.parent.name
    return Source(kind, spec, name)


class MethodFactory:
    """Builds :class:`Method` objects for one target from specs and run directories."""

    def __init__(self, target: TargetModel, runs: list[str | Path] = (), draft_layers: list[int] | None = None):
        self.target = target
        self.sources: dict[str, Source] = {"ngram": Source("ngram")}
        for run in runs:
            src = source_from_run(run)
            name = src.type if src.type not in self.sources or not self.sources[src.type].trained else f"{src.type}-{src.run}"
            if name in self.sources and self.sources[name].trained:
                raise ValueError(f"two runs named {src.run!r} of type {src.type!r}")
            self.sources[name] = src
        for kind in ("draft", "medusa", "eagle", "eagle3"):
            self.sources.setdefault(kind, Source(kind))
        self.draft_layers = draft_layers
        self._draft_lms: dict[str, TargetModel] = {}

    # -- drafters --------------------------------------------------------------------
    def draft_lm(self, source: Source) -> TargetModel:
        key = str(source.path)
        if key not in self._draft_lms:
            if source.path is not None:
                from specfoundry.runtime.models import load_target

                self._draft_lms[key] = load_target(str(source.path), device=self.target.device, dtype=self.target.dtype)
            else:
                L = self.target.num_layers
                layers = self.draft_layers or sorted({round(i * (L - 1) / max(1, round(L / 4) - 1))
                                                      for i in range(max(1, round(L / 4)))})
                self._draft_lms[key] = layer_subset_model(self.target, layers)
        return self._draft_lms[key]

    def _drafter(self, src: Source, shape: str, depth: int | None, nodes: int | None = None) -> Drafter:
        t = self.target
        if src.type == "ngram":
            return load_drafter("ngram", target=t, **({"depth": depth} if depth else {}))
        if src.type == "draft":
            return DraftModelDrafter(self.draft_lm(src), t, depth=depth or 4)
        where = str(src.path) if src.path is not None else src.type
        if src.type == "medusa":
            if shape == "chain":
                heads = load_drafter(where, target=t).heads
                k = min(depth or heads.num_heads, heads.num_heads)
                return load_drafter(where, target=t, choices=[[0] * i for i in range(1, k + 1)])
            return load_drafter(where, target=t)
        if nodes:
            return load_drafter(where, target=t, **tree_options(depth, nodes))
        tree = "chain" if shape == "chain" else "dynamic"
        return load_drafter(where, target=t, tree=tree, **({"depth": depth} if depth else {}))

    # -- methods ---------------------------------------------------------------------
    def plain(self) -> Method:
        return Method("plain", "our plain decoding (speculate=False)", "plain",
                      generator_runner(SpeculativeGenerator(self.target), speculate=False), draft_depth=0, reference="")

    def build(self, spec: str) -> Method:
        src_name, shape, depth, nodes = parse_spec(spec)
        if src_name == "plain":
            if shape or depth:
                raise ValueError(f"bad method spec {spec!r}: plain takes no shape or depth")
            return self.plain()
        if src_name == "plain-hf":
            if shape or depth:
                raise ValueError(f"bad method spec {spec!r}: plain-hf takes no shape or depth")
            # the same weights on the HF DynamicCache path: what the engine replaced, in the same run
            hf_path = TargetModel(self.target.model, self.target.tokenizer, name=self.target.name)
            return Method("plain-hf", "our plain decoding on the HF path (no engine)", "ours",
                          generator_runner(SpeculativeGenerator(hf_path), speculate=False), draft_depth=0)
        if src_name in HF_PEERS:
            return self._hf_peer(src_name, shape, depth, spec)
        if src_name in EXTERNAL_PEERS:
            raise ValueError(f"{src_name!r} is an out-of-process peer: pass it with --peers, not --methods")
        if src_name not in self.sources:
            raise ValueError(f"unknown method {spec!r}: sources are {sorted(self.sources)} (plus plain); "
                             f"peers are {list(HF_PEERS + EXTERNAL_PEERS)}")
        src = self.sources[src_name]
        shapes = SHAPES[src.type]
        shape = shape or shapes[0]
        if shape not in shapes:
            raise ValueError(f"unknown shape {shape!r} for {src_name} ({src.type}): choose from {list(shapes)}")
        if shape == "runtime":
            if depth:
                raise ValueError(f"bad method spec {spec!r}: runtime takes no depth (the run's stored shape has one)")
            method = self.build(self._runtime_spec(src_name, src))
            method.label += "; the run's runtime default (what generate and serve load)"
            return method
        adaptive = shape in ("adaptive", "lookup-adaptive")
        inner = {"adaptive": shapes[0], "lookup": "chain", "lookup-adaptive": shapes[0], "lookup-tree": "dynamic"}.get(shape, shape)
        drafter = self._drafter(src, inner, depth, nodes)
        k = depth or drafter.default_depth
        shape_text = {"chain": "chain", "static": "static tree", "dynamic": "dynamic tree (EAGLE-2)",
                      "adaptive": f"{shapes[0]} with adaptive depth"}.get(shape)
        if nodes:
            shape_text = f"dynamic tree (EAGLE-2) of {nodes} nodes"
        max_depth = k
        if shape in _LOOKUP or shape == "lookup-tree":
            drafter = LookupFirstDrafter(drafter)
            look = drafter.lookup
            max_depth = max(k, look.default_depth)  # the lookup chain may be deeper than the model's
            shape_text = (f"prompt lookup first (>= {look.min_ngram}-token match, <= {look.default_depth} tokens), "
                          f"else {'adaptive ' + shapes[0] if adaptive else (f'a {nodes}-node tree' if nodes else 'chain')}")
        gen = SpeculativeGenerator(self.target, RecordingDrafter(drafter), max_depth=max_depth, adaptive=adaptive)
        label = f"{src.type} ({src.describe()}), {shape_text}, depth {k}" + ("" if adaptive else ", fixed")
        return Method(f"{src_name}:{shape}@{k}" + (f"/{nodes}" if nodes else ""), label, "ours", generator_runner(gen),
                      draft_depth=k)

    def _runtime_spec(self, src_name: str, src: Source) -> str:
        """The spec of what ``generate`` / ``serve`` load for ``src`` by default: prompt lookup first (their
        ``--prompt-lookup 2``) before the shape the checkpoint's drafter loads with (its measured runtime
        shape; the drafter's own defaults fill what a stored shape leaves out)."""
        if not src.trained:
            raise ValueError(f"{src_name}:runtime needs a trained run (--run runs/<recipe>): an untrained head "
                             "has no measured runtime shape")
        d = load_drafter(str(src.path), target=self.target)
        if d.default_adaptive:
            return f"{src_name}:lookup-adaptive@{d.depth}"
        if d.tree == "chain":
            return f"{src_name}:lookup@{d.depth}"
        return f"{src_name}:lookup-tree@{d.depth}/{d.total_tokens}"

    def _hf_peer(self, name: str, shape, depth, spec: str) -> Method:
        if shape:
            raise ValueError(f"bad method spec {spec!r}: {name} takes no shape")
        if name == "hf":
            if depth:
                raise ValueError(f"bad method spec {spec!r}: hf takes no depth")
            return Method("hf", "HF transformers generate (plain)", "peer", hf_runner(self.target), draft_depth=0)
        if name == "hf-lookup":
            k = depth or 5
            return Method(f"hf-lookup@{k}", f"HF generate, prompt_lookup_num_tokens={k} (max ngram 3)", "peer",
                          hf_runner(self.target, prompt_lookup_num_tokens=k, max_matching_ngram_size=3), draft_depth=k)
        src = self.sources["draft"]
        kw = {"assistant_model": self.draft_lm(src).model}
        if depth:
            kw.update(num_assistant_tokens=depth, num_assistant_tokens_schedule="constant")
        what = f"our distilled draft ({src.run})" if src.trained else "untrained layer-subset draft"
        sched = f"{depth} tokens, constant" if depth else "HF default heuristic schedule"
        return Method("hf-assisted" + (f"@{depth}" if depth else ""), f"HF generate, assistant_model = {what} ({sched})",
                      "peer", hf_runner(self.target, **kw), draft_depth=depth)

    def default_specs(self) -> list[str]:
        """plain, prompt lookup, the draft model, and every head type a run provided, in all shapes (a fixed
        tree behind lookup, which needs a size, as the run's runtime shape; a spec that resolves to a method
        already listed is dropped by the caller)."""
        specs = ["plain", "ngram:chain", "ngram:adaptive", "draft:chain"]
        for name, src in self.sources.items():
            if src.trained and src.type != "ngram":
                specs += [f"{name}:{s}" for s in SHAPES[src.type]
                          if s != "lookup-tree" and not (src.type == "draft" and name == "draft" and s == "chain")]
        return specs
