"""The speculative generator: propose -> verify -> commit, one sequence at a time.

``SpeculativeGenerator(target, drafter).generate(...)`` returns exactly what the target alone
would produce at T=0 (and the target's distribution when sampling): every token it emits
comes from :func:`~specfoundry.runtime.verify.verify`. ``speculate=False`` runs plain
decoding through the same target path (each step a root-only draft).

Inputs are validated at this boundary, each with one ``ValueError`` sentence: sampling values
(:class:`~specfoundry.runtime.sampling.SamplingParams`), ``max_new_tokens``/``seed`` (integers),
messages (string roles and contents), prompt ids (integers inside the vocabulary), the draft
shape (``1 <= max_depth <= MAX_DRAFT_DEPTH``, ``2 <= max_nodes <= MAX_DRAFT_NODES``) and the
context: prompt + ``max_new_tokens`` beyond the target's ``max_position_embeddings`` is an error
unless ``context_overflow="truncate_prompt"`` asks to keep only the prompt's last tokens.

Threads: one generator (or several sharing a target) runs one sequence at a time. Each
``generate``/``stream`` holds the target's lock for the whole request, so threads sharing a
generator are served one after another with the same outputs as alone; a stream holds it until
it is exhausted or closed. The serving engine is the concurrent path.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from .adaptive import MAX_DRAFT_DEPTH, MAX_DRAFT_NODES, AcceptanceTally, AdaptiveController, check_int
from .drafters.base import DraftContext, Drafter
from .sampling import SamplingParams
from .target import TargetModel
from .tree import Draft, tree_layout
from .verify import verify


@dataclass
class GenerationStats:
    tau: float = 0.0  # new tokens per target forward (decode steps only)
    # conditional: P(draft at depth d accepted | depth d-1 accepted), d = 1..max depth
    acceptance_by_position: list[float] = field(default_factory=list)
    # the counts behind it (depth 1 first), so harnesses pool requests (runtime/tau.py)
    tried: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    target_forwards: int = 0
    drafted: int = 0  # draft nodes proposed (root excluded)
    accepted: int = 0  # draft tokens accepted
    new_tokens: int = 0
    seconds: float = 0.0  # wall clock, prefill included
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    speculative_steps: int = 0
    plain_steps: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        return d


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    stats: GenerationStats
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class StreamChunk:
    token_ids: list[int]  # tokens emitted by this step
    text: str  # the text they add
    stats: GenerationStats  # running stats (final once the stream ends)


class IncrementalDetokenizer:
    """Text deltas of a growing token list without re-decoding the whole output every step.

    Decodes a short window (from the start of the previous delta) and emits what it adds,
    holding text back while it ends in an incomplete UTF-8 sequence (U+FFFD), as streaming
    servers do; :meth:`flush` emits whatever is held at the end.
    """

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into emitted text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


class _TargetLock:
    """The lock serialising requests on one target, and the thread holding it (re-entry from the
    same thread, e.g. a generate() inside an open stream, would deadlock: it is refused)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: int | None = None


_TARGET_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TARGET_LOCKS_GUARD = threading.Lock()


def _lock_for(target) -> _TargetLock:
    with _TARGET_LOCKS_GUARD:
        try:
            lock = _TARGET_LOCKS.get(target)
            if lock is None:
                lock = _TARGET_LOCKS[target] = _TargetLock()
            return lock
        except TypeError:  # not weak-referenceable / hashable: a lock of its own
            return _TargetLock()


def _check_drafter_fits(drafter, target) -> None:
    """A drafter built for another target fails mid-generation with a shape error (or drafts
    nonsense): refuse it here, in one sentence."""
    layers = [int(i) for i in getattr(drafter, "feature_layers", ()) or ()]
    n = getattr(target, "num_layers", None)
    bad = [i for i in layers if not 0 <= i <= n] if isinstance(n, int) else []
    if bad:
        raise ValueError(f"the drafter reads target feature layers {bad}, outside [0, {n}] of this target")
    module = getattr(drafter, "head", None) or getattr(drafter, "heads", None)
    built_for = getattr(module, "target_identity", None)
    identity = getattr(target, "identity", None)
    if isinstance(built_for, dict) and callable(identity):  # targets that know their identity (not ONNX ones)
        given = identity()
        differ = [k for k in ("vocab_size", "hidden_size", "num_layers", "fingerprint")
                  if k in built_for and built_for[k] != given.get(k)]
        if differ:
            raise ValueError(f"the drafter was built for target {built_for.get('name')!r}, not {given.get('name')!r} "
                             f"(they differ in {', '.join(differ)}); load it with load_drafter(..., target=this target)")
    lm = getattr(drafter, "lm", None)
    V = getattr(target, "vocab_size", None)
    if lm is not None and V is not None and getattr(lm, "vocab_size", V) != V:
        raise ValueError(f"the draft model's vocabulary ({lm.vocab_size}) differs from the target's ({target.vocab_size})")


CONTEXT_OVERFLOW = ("error", "truncate_prompt")
# the KV cache is preallocated for prompt + max_new_tokens: without a context length to check
# against, this bounds what one request can allocate
MAX_NEW_TOKENS_UNKNOWN_CONTEXT = 1 << 17


def _runs_on_cuda(target) -> bool:
    from .engine import EngineTarget

    return isinstance(target, EngineTarget) and target.device.type == "cuda"


def _with_cuda_graphs(target, cuda_graphs: bool | None):
    """``target`` with its decode and verification steps captured in CUDA graphs
    (:class:`~.cuda_graph.GraphedTarget`) where it is an engine target on CUDA and ``cuda_graphs``
    is not False: on an H200 a SmolLM2-135M step took 2.3-3.0 ms graphed against 10-13 ms eager,
    same logits (docs/results.md, twenty-fifth session). True elsewhere is an error."""
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs must be True, False or None (on CUDA engine targets), got {cuda_graphs!r}")
    if cuda_graphs is False:
        return target
    if not _runs_on_cuda(target):
        if cuda_graphs:
            raise ValueError(f"cuda_graphs=True needs an engine target on CUDA (load_target(..., device='cuda', "
                             f"backend='engine')); got {type(target).__name__} on {getattr(target, 'device', '?')}")
        return target
    from .cuda_graph import GraphedTarget

    return GraphedTarget(target)


class SpeculativeGenerator:
    """Lossless speculative decoding of one sequence with ``target`` and ``drafter``.

    ``max_depth``/``max_nodes`` cap the draft (default: the drafter's own, at most
    ``MAX_DRAFT_DEPTH``/``MAX_DRAFT_NODES``); ``adaptive`` lets :class:`AdaptiveController`
    choose the depth per step from measured acceptance and costs (turn it off for reproducible
    sampling runs with a fixed draft shape; None, the default: the drafter's ``default_adaptive``,
    which a trained head's measured runtime shape sets, :mod:`~specfoundry.runtime.tune`).
    ``cuda_graphs``: an engine target on CUDA runs its steps in CUDA graphs (None, the default, or
    True; False keeps them eager); elsewhere None does nothing and True is an error.

    Thread safety: an instance may be shared between threads. Every ``generate``/``stream`` call
    holds a lock of the target for the whole request (generators sharing one target share it),
    so concurrent calls run one after another and each returns what it would alone; a stream
    keeps the lock until it is exhausted or closed, and the same thread may not start another
    request on that target meanwhile (``RuntimeError``). For concurrent sequences use the
    serving engine.
    """

    def __init__(self, target: TargetModel, drafter: Drafter | None = None, *, max_depth: int | None = None,
                 max_nodes: int | None = None, adaptive: bool | None = None, cuda_graphs: bool | None = None):
        self.target = _with_cuda_graphs(target, cuda_graphs)
        self.drafter = drafter
        if drafter is not None and not all(callable(getattr(drafter, m, None)) for m in ("begin", "propose", "commit")):
            raise ValueError(f"drafter must be a Drafter (begin/propose/commit), e.g. load_drafter('ngram', target=...); "
                             f"got {type(drafter).__name__} {drafter!r:.60}")
        if drafter is not None:
            _check_drafter_fits(drafter, target)
            if callable(getattr(drafter, "use_cuda_graphs", None)):  # a head drafts graphed beside a graphed target
                from .cuda_graph import GraphedTarget  # (wrapped here or by the caller)

                drafter.use_cuda_graphs(isinstance(self.target, GraphedTarget))
        if max_depth is not None:
            check_int("max_depth", max_depth, 1, MAX_DRAFT_DEPTH)  # 0 or less: pass speculate=False instead
        if max_nodes is not None:
            check_int("max_nodes", max_nodes, 2, MAX_DRAFT_NODES)  # the root and at least one draft
        if adaptive is None:  # the drafter's default (a trained head's measured runtime shape may be fixed)
            adaptive = bool(getattr(drafter, "default_adaptive", True))
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True, False or None (the drafter's default), got {adaptive!r}")
        self.max_depth = max_depth if max_depth is not None else \
            (min(int(drafter.default_depth), MAX_DRAFT_DEPTH) if drafter else 0)
        self.max_nodes = max_nodes if max_nodes is not None else \
            (min(int(drafter.default_nodes), MAX_DRAFT_NODES) if drafter else 1)
        self.adaptive = adaptive
        self._control: AdaptiveController | None = None
        self._lock = _lock_for(target)  # the target's own, not the CUDA-graph wrapper's: shared by its generators

    @contextlib.contextmanager
    def _exclusive(self):
        tl, me = self._lock, threading.get_ident()
        if tl.owner == me:
            raise RuntimeError("this thread is already running a request on this target (an unfinished stream?): "
                               "exhaust or close() it first; a target decodes one sequence at a time")
        with tl.lock:
            tl.owner = me
            try:
                yield
            finally:
                tl.owner = None

    # -- public API --------------------------------------------------------------------
    def generate(self, messages: list[dict] | None = None, *, prompt: str | None = None,
                 prompt_ids: list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = 0, speculate: bool = True, stop_at_eos: bool = True,
                 context_overflow: str = "error") -> GenerationOutput:
        ids: list[int] = []
        stats = None
        args = self._request(messages, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                             speculate, stop_at_eos, context_overflow)
        with self._exclusive():
            for chunk in self._run(*args):
                ids.extend(chunk.token_ids)
                stats = chunk.stats
        return GenerationOutput(ids, self.target.decode(ids) if ids else "", stats, args[0])

    def stream(self, messages: list[dict] | None = None, *, prompt: str | None = None,
               prompt_ids: list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = 0, speculate: bool = True, stop_at_eos: bool = True,
               context_overflow: str = "error") -> Iterator[StreamChunk]:
        """Like :meth:`generate`, one :class:`StreamChunk` per step. Arguments are checked now;
        the request runs (holding the target's lock) as the stream is consumed."""
        args = self._request(messages, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                             speculate, stop_at_eos, context_overflow)

        def run() -> Iterator[StreamChunk]:
            with self._exclusive():
                yield from self._run(*args)

        return run()

    # -- internals ---------------------------------------------------------------------
    def _request(self, messages, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, speculate,
                 stop_at_eos, context_overflow) -> tuple:
        """Validate one request's arguments: ``(prompt ids, max_new_tokens, sampling, seed,
        speculate, stop_at_eos)`` for :meth:`_run`, or one ValueError."""
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        sampling = SamplingParams(temperature, top_k, top_p)
        if seed is not None:
            seed = check_int("seed", seed, 0, 2**64 - 1)
        for name, flag in (("speculate", speculate), ("stop_at_eos", stop_at_eos)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if context_overflow not in CONTEXT_OVERFLOW:
            raise ValueError(f"context_overflow must be one of {CONTEXT_OVERFLOW}, got {context_overflow!r}")
        ids = self._prompt_ids(messages, prompt, prompt_ids)
        limit = self.context_length
        if limit is None and max_new_tokens > MAX_NEW_TOKENS_UNKNOWN_CONTEXT:
            raise ValueError(f"max_new_tokens {max_new_tokens} is more than {MAX_NEW_TOKENS_UNKNOWN_CONTEXT} and the "
                             "target states no context length (max_position_embeddings) to check it against")
        if limit is not None and len(ids) + max_new_tokens > limit:
            if context_overflow == "truncate_prompt" and max_new_tokens < limit:
                ids = ids[len(ids) + max_new_tokens - limit:]
            else:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {len(ids) + max_new_tokens} "
                    f"exceeds the target's context of {limit} tokens (max_position_embeddings); shorten the prompt, "
                    "lower max_new_tokens, or pass context_overflow='truncate_prompt' to keep the prompt's last tokens")
        return ids, max_new_tokens, sampling, seed, speculate, stop_at_eos

    @property
    def context_length(self) -> int | None:
        """The target's context (``config.max_position_embeddings``), None when it states none."""
        cfg = getattr(self.target, "config", None) or getattr(getattr(self.target, "model", None), "config", None)
        n = getattr(cfg, "max_position_embeddings", None)
        return int(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None

    def _prompt_ids(self, messages, prompt, prompt_ids) -> list[int]:
        given = [x is not None for x in (messages, prompt, prompt_ids)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of messages=, prompt= or prompt_ids=")
        if messages is not None:
            if not isinstance(messages, (list, tuple)) or not messages:
                raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"messages[{i}] must be a {{'role': str, 'content': str}} dict, got {m!r:.80}")
                if not isinstance(m["role"], str) or not m["role"]:
                    raise ValueError(f"messages[{i}]['role'] must be a non-empty string, got {m['role']!r:.80}")
                if not isinstance(m["content"], str):
                    raise ValueError(f"messages[{i}]['content'] must be a string, got "
                                     f"{type(m['content']).__name__} {m['content']!r:.80}")
            ids = self.target.encode_chat(list(messages))
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__} {prompt!r:.80}")
            ids = self.target.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = self._check_ids(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        return [int(i) for i in ids]

    def _check_ids(self, prompt_ids) -> list[int]:
        V = self.target.vocab_size
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
                raise ValueError(f"prompt_ids must hold integer token ids, got a {prompt_ids.dtype} tensor")
            if prompt_ids.dim() > 2 or (prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1):
                raise ValueError(f"prompt_ids must be one sequence ([L] or [1, L]), got shape {tuple(prompt_ids.shape)}")
            ids = prompt_ids.reshape(-1).tolist()
        elif isinstance(prompt_ids, (list, tuple)):
            ids = list(prompt_ids)
            bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int)), None)
            if bad is not None:
                raise ValueError(f"prompt_ids must be integers, got {type(bad).__name__} {bad!r:.40}")
        else:
            raise ValueError(f"prompt_ids must be a list of ints or an integer tensor, got {type(prompt_ids).__name__}")
        out = [i for i in ids if not 0 <= i < V]
        if out:
            raise ValueError(f"prompt_ids holds {len(out)} id(s) outside the vocabulary [0, {V}), e.g. {out[0]}")
        return ids

    def _run(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, seed, speculate: bool,
             stop_at_eos: bool) -> Iterator[StreamChunk]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self.context_length
        target, dev = self.target, self.target.device
        drafter = self.drafter if speculate else None
        gen = torch.Generator(device=dev)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        eos = target.eos_token_ids if stop_at_eos else set()
        feature_layers = tuple(drafter.feature_layers) if drafter else ()
        max_depth = self.max_depth if drafter else 0
        pre_draft = getattr(drafter, "pre_draft", None)
        adaptive = self.adaptive and drafter is not None
        if adaptive:
            # one controller per generator: what it measured (acceptance, costs) carries over requests
            if self._control is None or self._control.max_depth != max_depth:
                curve = getattr(target, "cost_curve", None)
                self._control = AdaptiveController(max_depth, cost_curve=curve() if curve else None)
            control = self._control
            control.new_request()
        else:
            control = AdaptiveController(max_depth, enabled=False)
        tally = AcceptanceTally(max_depth)  # this request's own acceptance figures
        shapes = self._shapes(max_depth)
        stats = GenerationStats()

        t_start = time.perf_counter()
        ids = torch.tensor([prompt], dtype=torch.long, device=dev)
        # room for the prompt, the output and one step's draft nodes: a static cache never regrows
        cache = target.new_cache(capacity=len(prompt) + max_new_tokens + max(self.max_nodes, 1) + 1)
        if ids.shape[1] > 1:
            prefill = target.forward(ids[:, :-1], cache, feature_layers=feature_layers,
                                     logits_for=torch.zeros(0, dtype=torch.long))
            cache.commit()
            features = prefill.features
        else:  # a one-token prompt: nothing to prefill, the token is the first root
            features = torch.zeros(1, 0, len(feature_layers), target.hidden_size, dtype=target.dtype, device=dev)
        if drafter is not None:
            drafter.begin(ids, features if feature_layers else None)
        stats.prefill_seconds = time.perf_counter() - t_start
        emitted = []
        detok = IncrementalDetokenizer(target.decode) if target.tokenizer is not None else None
        root_id = prompt[-1]  # the root as a host int (the last id the loop appended to ids)
        while len(emitted) < max_new_tokens:
            t0 = time.perf_counter()
            # no draft node past the last position the target knows
            room = min(max_depth, self.max_nodes - 1)
            if limit is not None:
                room = max(0, min(room, limit - ids.shape[1]))
            draft = pre_draft(ids, room, root_id) if pre_draft is not None and room > 0 else None
            shape = None  # a pre-drafted step is not the controller's
            if draft is None:
                shape = control.choose(shapes) if drafter is not None else (0, 1)
                depth = min(shape[0], room)
                if depth > 0:
                    draft = drafter.propose(DraftContext(ids, sampling, depth, shape[1], gen, root_id))
                else:
                    draft = Draft.root_only(ids[:, -1], root_id)
            t1 = time.perf_counter()
            # the step's bookkeeping over host lists and per-shape tensors made once (tree_layout):
            # right after a forward each tensor op costs ~10-40 us on flushed caches
            toks, parents = draft.lists()
            layout = tree_layout(parents, dev)
            # a plain step's position follows the cache (the engine slices its RoPE tables: no tensor op)
            positions = None if layout.mask is None else cache.length + layout.depths
            out = target.forward(draft.tokens, cache, position_ids=positions, tree_mask=layout.mask,
                                 feature_layers=feature_layers)
            res = verify(draft, out.logits, sampling, gen)
            n_acc, path, next_id = res.lists()
            cache.commit(path)
            new_ids = [toks[i] for i in path[1:]] + [next_id]
            new, root_id = torch.tensor([new_ids], dtype=torch.long, device=dev), next_id
            feats = out.features
            if feats is not None and feats.shape[1] > 1:  # the accepted path's (the root's alone: a slice)
                feats = feats[:, :1] if len(path) == 1 else feats[:, path]
            t2 = time.perf_counter()
            if drafter is not None:
                drafter.commit(new, feats)
            t3 = time.perf_counter()

            n_drafted = draft.num_nodes - 1
            depth_drafted = layout.max_depth
            if shape is not None:
                control.record(shape, depth_drafted, n_acc, draft.num_nodes, t2 - t1, (t1 - t0) + (t3 - t2))
            tally.record(depth_drafted, n_acc)
            stats.target_forwards += 1
            stats.drafted += n_drafted
            stats.accepted += n_acc
            stats.draft_seconds += (t1 - t0) + (t3 - t2)
            stats.verify_seconds += t2 - t1
            if n_drafted:
                stats.speculative_steps += 1
            else:
                stats.plain_steps += 1

            ids = torch.cat([ids, new], dim=1)
            step_tokens = new_ids[: max_new_tokens - len(emitted)]
            done = False
            for i, t in enumerate(step_tokens):
                if t in eos:
                    step_tokens, done = step_tokens[: i + 1], True
                    break
            emitted.extend(step_tokens)
            stats.new_tokens = len(emitted)
            stats.seconds = time.perf_counter() - t_start
            stats.tau = stats.new_tokens / stats.target_forwards
            stats.acceptance_by_position = tally.observed()
            stats.tried, stats.passed = tally.tried[1:], tally.passed[1:]
            delta = detok.push(step_tokens) if detok is not None else ""
            last = done or len(emitted) >= max_new_tokens
            if last and detok is not None:
                delta += detok.flush()
            yield StreamChunk(step_tokens, delta, stats)
            if done:
                break

    def _shapes(self, max_depth: int) -> list[tuple[int, int]]:
        """Draft shapes ``(depth, nodes)`` the adaptive controller chooses among, the fixed shape
        (``max_depth``, ``max_nodes``) last: chains of every depth and, for drafters that grow
        trees, node budgets of 4, 8, 16, 32, 64 up to ``max_nodes``."""
        if max_depth == 0:
            return [(0, 1)]
        trees = self.max_nodes > self.max_depth + 1
        shapes = []
        for k in range(1, max_depth + 1):
            sizes = {k + 1} | ({n for n in (4, 8, 16, 32, 64, self.max_nodes) if k + 1 < n <= self.max_nodes}
                               if trees else set())
            shapes += [(k, n) for n in sorted(sizes)]
        fixed = (max_depth, self.max_nodes if trees else max_depth + 1)
        return [s for s in shapes if s != fixed] + [fixed]
