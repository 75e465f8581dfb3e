"""Continuous batching with lossless speculative decoding: the embeddable serving engine.

Scope: requests in, token events out. :class:`ServingEngine` owns a target on the engine, one
drafter (forked per sequence) and a :class:`~.slots.SlotCache`; a background thread runs steps:

1. admit waiting requests (up to ``max_batch`` decoding or prefilling);
2. :class:`~.policy.SpeculationPolicy` picks each sequence's draft depth for this batch size
   (0 = plain) and, behind prompt lookup, which rows draft their lookup chain instead (where it
   pays at this batch); each other speculating sequence's drafter proposes a chain/tree (EAGLE
   heads for all rows at once, :mod:`.drafts`);
3. the drafts are padded to one node count and verified in **one** batched forward, which also
   carries the next chunks of the prompts being prefilled (chunked prefill, up to
   ``max_step_tokens`` per forward; :func:`~.slots.forward_mixed`): a prefilled request takes a
   slot row and decodes from the next step on;
4. per sequence: :func:`~specfoundry.runtime.verify.verify` (its own sampler and seed), the KV
   of the accepted nodes kept in place, the drafter told, tokens streamed to the request.

Every emitted token comes from ``verify``, so each request's greedy output is the target's own
greedy output whatever else is in the batch, and sampling keeps the target's distribution.

Thread-safety: :meth:`ServingEngine.submit` and :meth:`RequestHandle.cancel` may be called from
any thread; everything touching the model runs on the engine's own thread. The waiting queue is
bounded (:class:`QueueFull` when it is full). The request-side types (:class:`Request`,
:class:`Event`, :class:`RequestHandle`, ...) are defined in :mod:`.requests` and re-exported here.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import threading
import time
from collections import deque

import torch

from ..drafters.base import DraftContext, Drafter
from ..drafters.lookup import LookupFirstDrafter
from ..engine import EngineTarget
from ..generator import IncrementalDetokenizer
from ..native import release_free_memory
from ..sampling import SamplingParams
from ..tree import Draft, ancestor_matrix, tree_depths
from ..verify import verify
from .drafts import SlotDrafts
from .policy import SpeculationPolicy
from .requests import Event, QueueFull, Request, RequestHandle, RequestStats
from .slots import KERNEL_TOKENS_PER_ROW, SlotCache, forward_mixed, forward_slots

__all__ = ["Event", "NullMetrics", "QueueFull", "Request", "RequestHandle", "RequestStats", "ServingEngine"]


MIN_TEMPERATURE = 1e-5
#: seconds between returns of freed memory to the system under load (:func:`..native.release_free_memory`)
TRIM_SECONDS = 10.0
MIN_TOP_P = 1e-6


class _Seq:
    """Per-sequence state on the engine thread."""

    def __init__(self, handle: RequestHandle, drafter: Drafter | None, monitor, device, decode):
        r = handle.request
        self.handle = handle
        self.ids = torch.tensor([r.prompt_ids], dtype=torch.long, device=device)  # committed tokens
        # below these float32 sampling breaks (inf logits; a top_p that keeps nothing) and the result
        # is the top token anyway: a tiny temperature is greedy, a tiny top_p keeps the top token
        temperature = 0.0 if r.temperature < MIN_TEMPERATURE else float(r.temperature)
        top_p = None if r.top_p is None else max(float(r.top_p), MIN_TOP_P)
        self.sampling = SamplingParams(temperature, r.top_k, top_p)
        self.gen = torch.Generator(device=device)
        if r.seed is not None:
            self.gen.manual_seed(r.seed)
        else:
            self.gen.seed()
        self.drafter = drafter
        self.lookup = None  # prompt-lookup state of a batched row whose drafter looks up first
        self.monitor = monitor
        self.detok = IncrementalDetokenizer(decode)
        self.stats = RequestStats()
        self.emitted = 0
        self.started = time.perf_counter()
        self.last_token_at: float | None = None


class NullMetrics:
    """The hooks :class:`ServingEngine` calls; the server passes Prometheus-backed ones."""

    def step(self, batch: int, queue_depth: int, speculating: int, seconds: float) -> None: ...
    def drafts(self, drafted: int, accepted: int, depth: int) -> None: ...
    def tokens(self, n: int, first: bool, seconds_since_last: float | None) -> None: ...
    def first_token(self, seconds: float) -> None: ...  # submission to first token, when it comes
    def finished(self, reason: str, prompt_tokens: int, stats: RequestStats | None) -> None: ...


class ServingEngine:
    """Serve ``target`` (an :class:`~specfoundry.runtime.engine.EngineTarget`) with ``drafter``
    (None: plain decoding) to concurrent requests; see the module docstring.

    ``max_batch`` sequences decode together; ``max_queue`` more may wait; ``max_context`` bounds
    prompt + new tokens per request (default: the model's context, at most 4096);
    ``speculation_table`` overrides the load-aware depth (``"1-4:3,5-8:1,9-:0"``);
    ``max_step_tokens`` bounds the tokens of one forward: prompts are prefilled in chunks that share
    the decode rows' forward (chunked prefill), as much of them per step as the decode rows leave.

    ``background=True`` (default): the steps run on a thread of the engine's own, started by the
    first :meth:`submit`. ``background=False``: the owner calls :meth:`run` on the thread it wants
    the model to run on (it returns after :meth:`close`). Prefer the thread that loaded the model,
    so that one thread does all of the process's torch work: torch's OpenMP runtime (libgomp) keeps
    a pool of workers per thread that ever ran parallel work, and once the pools hold more threads
    than there are cores every worker stops spinning between parallel regions and sleeps; each of
    a step's ~1,000 small parallel regions then waits for its workers to wake up. Measured on 2
    cores (SmolLM2-135M, bf16, 32 rows): a step 2-3x slower on a second thread than on the thread
    that loaded the model, and the whole engine under 32 clients 36-41 against 73-81 tok/s
    (docs/results.md, fifteenth session). ``specfoundry serve`` runs the engine on its main thread.
    """

    def __init__(self, target: EngineTarget, drafter: Drafter | None = None, *, max_batch: int = 8,
                 max_queue: int = 64, max_context: int | None = None, max_depth: int | None = None,
                 speculation_table: str | None = None, metrics=None, cost_curve: dict | None = None,
                 max_step_tokens: int = 512, background: bool = True):
        if not isinstance(target, EngineTarget):
            raise ValueError("serving needs a target on the engine backend (a Llama-family model; "
                             "load it with backend='engine')")
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch ({max_batch}) must be >= 1 and max_queue ({max_queue}) >= 0")
        if isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int) or max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be an integer >= 1, got {max_step_tokens!r}")
        self.max_step_tokens = max_step_tokens
        self.target = target
        self.drafter = drafter
        self.max_batch, self.max_queue = max_batch, max_queue
        model_ctx = int(getattr(target.config, "max_position_embeddings", 4096) or 4096)
        self.max_context = min(max_context or min(model_ctx, 4096), model_ctx)
        depth = (drafter.default_depth if drafter is not None else 0) if max_depth is None else max_depth
        if not 0 <= depth <= 16:
            raise ValueError(f"max_depth must be in 0..16, got {depth}")
        self.max_depth = depth if drafter is not None else 0
        self.feature_layers = tuple(drafter.feature_layers) if drafter is not None else ()
        curve = cost_curve if cost_curve is not None else (target.cost_curve() if self.max_depth else None)
        self._lookup = drafter.lookup if isinstance(drafter, LookupFirstDrafter) else None
        head_drafter = drafter.inner if self._lookup is not None else drafter
        # the head drafts at most its own depth (the lookup chain may go deeper)
        self._head_depth = min(head_drafter.default_depth, self.max_depth) if head_drafter is not None else 0
        # without a drafter there is nothing to tabulate: every step is plain
        self.policy = SpeculationPolicy(self._head_depth, curve, speculation_table if self.max_depth else None,
                                        lookup_depth=self.max_depth)
        self.metrics = metrics or NullMetrics()
        self.engine = target._engine()
        # a row holds a whole request plus one step's draft nodes
        self.slots = SlotCache(self.engine, max_batch, self.max_context + self.max_depth + 2)
        # the policy prices a step at the unit of the attention it will run (:func:`.slots.uses_kernel`)
        self.policy.plain_rows = KERNEL_TOKENS_PER_ROW if self.slots.kernel else 1.0
        # EAGLE heads draft for every row at once (one head forward per depth, :mod:`.drafts`)
        # (behind prompt lookup too: a row drafts its lookup chain when the policy takes it, else with the head)
        self.slot_drafts = None
        # a head whose shape is a small tree (its measured runtime shape) drafts that tree for greedy
        # rows at its full depth: (nodes, top_k), else None (chains)
        self._tree = None
        if self.max_depth and hasattr(getattr(head_drafter, "head", None), "step_rows") and \
                getattr(head_drafter, "_static", False):
            if getattr(head_drafter, "tree", "chain") == "dynamic" and self._head_depth == head_drafter.default_depth \
                    and head_drafter.total_tokens > self._head_depth + 1:
                self._tree = (head_drafter.total_tokens, head_drafter.top_k)
            width = self._tree[1] * self._head_depth if self._tree else self.max_depth
            self.slot_drafts = SlotDrafts(head_drafter.head, max_batch, self.max_context + max(width, self.max_depth) + 2,
                                          head_drafter.draft_temperature, head_drafter.prompt_window)
        self._waiting: deque[RequestHandle] = deque()
        self._seqs: list[_Seq] = []
        self._filling: deque[_Fill] = deque()  # admitted, prompt being prefilled (no slot row yet)
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._stop = False
        self._trimmed = time.monotonic()
        self._thread: threading.Thread | None = None
        self.background = bool(background)
        self.steps = 0
        self._verified_at: float | None = None  # the last decode step's end of drafting + verification
        self._errors: dict[int, str] = {}  # row -> error of the current step's failed requests

    # -- public, any thread ------------------------------------------------------------------
    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue ``request``; events go to the returned handle (to ``loop`` for asyncio callers).
        Raises ValueError for an invalid request and :class:`QueueFull` when the queue is full."""
        self._validate(request)
        handle = RequestHandle(next(self._ids), request, loop)
        with self._lock:
            if self._stop:
                raise RuntimeError("the serving engine is closed")
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - self._admitted()):
                raise QueueFull(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue})")
            self._waiting.append(handle)
            self._lock.notify()
        self._ensure_thread()
        return handle

    def generate(self, request: Request) -> tuple[list[int], str, Event]:
        """Submit and wait: (token ids, text, last event)."""
        return self.submit(request).result()

    def load(self) -> dict:
        with self._lock:
            return {"running": self._admitted(), "waiting": len(self._waiting), "max_batch": self.max_batch,
                    "max_queue": self.max_queue}

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine (its thread, or :meth:`run`); waiting and running requests finish as
        "cancelled". Waits up to ``timeout`` seconds for the background thread; never for :meth:`run`,
        which returns on its own thread (close may be called from a signal handler there)."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self.background and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def run(self) -> None:
        """Run the steps on the calling thread until :meth:`close` (engines made with
        ``background=False``; see the class docstring for which thread to call it on)."""
        if self.background:
            raise RuntimeError("this engine runs on its own thread (background=True): run() is for background=False")
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("run() is already running (or has run) on "
                                   f"thread {self._thread.name!r}")
            self._thread = threading.current_thread()
        self._run()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _admitted(self) -> int:
        """Requests holding a place in the batch: decoding, or being prefilled."""
        return len(self._seqs) + len(self._filling)

    def _validate(self, r: Request) -> None:
        ids = r.prompt_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("prompt_ids must be a non-empty list of token ids (int)")
        vocab = self.target.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if not isinstance(r.max_new_tokens, int) or isinstance(r.max_new_tokens, bool) or r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")
        if len(ids) + r.max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds the "
                             f"context of {self.max_context} tokens")
        if not isinstance(r.temperature, (int, float)) or not math.isfinite(r.temperature) or not 0 <= r.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {r.temperature!r}")
        if r.top_p is not None and (not isinstance(r.top_p, (int, float)) or not 0 < r.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {r.top_p!r}")
        if r.top_k is not None and (not isinstance(r.top_k, int) or isinstance(r.top_k, bool) or r.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {r.top_k!r}")
        if r.seed is not None and (not isinstance(r.seed, int) or isinstance(r.seed, bool) or not -2**63 <= r.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {r.seed!r}")

    def _ensure_thread(self) -> None:
        if not self.background:  # the owner's run() serves the queue
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="specfoundry-serving", daemon=True)
                self._thread.start()

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self._waiting and not self._seqs and not self._filling:
                        self._lock.wait()
                    if self._stop:
                        break
                    admit = []
                    while self._waiting and self._admitted() + len(admit) < self.max_batch:
                        admit.append(self._waiting.popleft())
                    queued = len(self._waiting)
                if admit:  # a prefill between two steps is not per-step overhead
                    self._verified_at = None
                for handle in admit:
                    self._admit(handle)
                self._drop_cancelled()
                if self._seqs or self._filling:
                    self._step(queued)
                now = time.monotonic()
                if now - self._trimmed >= TRIM_SECONDS or not (self._seqs or self._filling or self._waiting):
                    release_free_memory()  # ~10 ms: every TRIM_SECONDS under load, and whenever it goes idle
                    self._trimmed = now
                    self._verified_at = None
        except Exception as e:  # a bug must not leave clients waiting forever
            msg = f"{type(e).__name__}: {e}"
            for s in list(self._seqs):
                s.handle._put(Event([], "", "error", error=msg))
            with self._lock:
                self._stop = True
            raise
        finally:
            with self._lock:
                waiting, self._waiting = list(self._waiting), deque()
            for h in waiting:
                h._put(Event([], "", "cancelled"))
            for s in self._seqs + [f.seq for f in self._filling]:
                if not s.handle.finished.is_set():
                    s.handle._put(Event([], "", "cancelled", stats=s.stats.as_dict()))

    @torch.inference_mode()
    def _admit(self, handle: RequestHandle) -> None:
        if handle.cancelled.is_set():
            handle._put(Event([], "", "cancelled"))
            self.metrics.finished("cancelled", len(handle.request.prompt_ids), None)  # cancelled while waiting
            return
        r = handle.request
        drafter = None
        if self.drafter is not None and r.speculate and self.max_depth:
            drafter = _BATCHED if self.slot_drafts is not None else self.drafter.fork()
        seq = _Seq(handle, drafter, self.policy.monitor(drafter is not None), self.engine.device, self.target.decode)
        if drafter is _BATCHED and self._tree is not None and seq.sampling.greedy:
            seq.monitor.tree_nodes = self._tree[0]  # sampling rows draft chains (serving trees are greedy)
        if drafter is _BATCHED and self._lookup is not None:
            seq.lookup = self._lookup.fork()
        seq.stats.queued_seconds = seq.started - handle.submitted
        # the whole prompt is prefilled in chunks by the next steps; the last chunk's logits give
        # the first token
        self._filling.append(_Fill(seq, self.engine.new_cache(capacity=seq.ids.shape[1])))

    def _start(self, fill: "_Fill", logits: torch.Tensor, finished: list) -> None:
        """A prefilled request takes the next slot row (its prefill KV copied in), gets its first
        token from the prompt's last logits (verified as a root-only step) and decodes."""
        seq = fill.seq
        row = self.slots.add(fill.cache)
        n = fill.cache.length
        self._seqs.append(seq)
        draft = Draft.root_only(seq.ids[:, -1])
        try:
            res = verify(draft, logits.view(1, 1, -1), seq.sampling, seq.gen)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._errors[row] = f"{type(e).__name__}: {e}"
            finished.append((row, "error"))
            return
        new = res.next_token.view(1, 1)
        if seq.drafter is not None:
            if fill.features and fill.features[0] is not None:
                feats = torch.cat(fill.features, dim=1)  # [1, L, F, H]
            else:
                feats = torch.zeros(1, n, len(self.feature_layers), self.target.hidden_size, dtype=self.target.dtype)
            try:  # as if a root-only step had run after a prefill of all but the root
                if seq.drafter is _BATCHED:
                    self.slot_drafts.begin(row, seq.ids, feats[:, :-1])
                    self.slot_drafts.commit(row, new, feats[:, -1:])
                    if seq.lookup is not None:
                        seq.lookup.begin(seq.ids)
                        seq.lookup.commit(new)
                else:
                    seq.drafter.begin(seq.ids, feats[:, :-1] if self.feature_layers else None)
                    seq.drafter.commit(new, feats[:, -1:] if self.feature_layers else None)
            except Exception as e:  # noqa: BLE001
                self._drop_drafter(seq, e)
        self._emit(row, seq, draft, 0, False, 0, new, time.perf_counter(), finished)

    def _drop_cancelled(self) -> None:
        for row in range(len(self._seqs) - 1, -1, -1):
            if self._seqs[row].handle.cancelled.is_set():
                self._finish(row, "cancelled")
        for fill in [f for f in self._filling if f.seq.handle.cancelled.is_set()]:
            self._filling.remove(fill)
            seq = fill.seq
            seq.stats.seconds = time.perf_counter() - seq.handle.submitted
            seq.handle._put(Event([], "", "cancelled", stats=seq.stats.as_dict()))
            self.metrics.finished("cancelled", len(seq.handle.request.prompt_ids), seq.stats)

    def _drop_drafter(self, seq: "_Seq", error: Exception) -> None:
        """A drafter that raised: this request goes on with plain decoding (still lossless)."""
        print(f"[specfoundry] request {seq.handle.id}: drafter failed ({type(error).__name__}: {error}); "
              "continuing without speculation", file=sys.stderr)
        seq.drafter = seq.lookup = None

    def _finish(self, row: int, reason: str) -> None:
        seq = self._seqs[row]
        seq.stats.seconds = time.perf_counter() - seq.handle.submitted
        tail = seq.detok.flush() if reason not in ("cancelled", "error") else ""
        error = self._errors.get(row) if reason == "error" else None
        seq.handle._put(Event([], tail, reason, error=error, stats=seq.stats.as_dict()))
        self.metrics.finished(reason, len(seq.handle.request.prompt_ids), seq.stats)
        moved = self.slots.remove(row)
        if self.slot_drafts is not None:
            self.slot_drafts.remove(row, row if moved is None else moved)
        last = self._seqs.pop()
        if moved is not None:
            self._seqs[row] = last

    @torch.inference_mode()
    def _step(self, queued: int) -> None:
        if not self._seqs:  # nothing decodes yet: this step only prefills
            self._verified_at = None
            self._prefill_only()
            return
        seqs, dev = self._seqs, self.engine.device
        t0 = time.perf_counter()
        if self._verified_at is not None:  # the last step's emission and the loop since: per-step overhead
            self.policy.record_overhead(t0 - self._verified_at)
        caught_up = self.slot_drafts.catchup_seconds if self.slot_drafts is not None else 0.0
        monitors = [s.monitor if s.drafter is not None else _OFF for s in seqs]
        depths = self.policy.choose(monitors)
        drafts, failed = [None] * len(seqs), {}
        # prompt lookup: what followed the context's suffix before (no head forward), for the rows
        # whose lookup the policy says pays at this batch (even those it has at depth 0)
        # (lengths only: a row's chain is built only if its lookup is taken; most rows' are not under load)
        lengths = [len(s.lookup.lookup(min(s.lookup.default_depth, self.max_depth)))
                   if s.lookup is not None and s.monitor.enabled else 0 for s in seqs]
        # a step that also prefills while the policy has the head off (high load): no lookup rows either;
        # they take the prompts' share of the forward and delay admissions (measured at 32 clients:
        # lookups taken in such steps cost load-aware 6-13% against off)
        crowded = bool(self._filling) and not any(depths)
        looked = self.policy.take_lookups(monitors, depths, lengths) if any(lengths) and not crowded \
            else [False] * len(seqs)
        batched: dict[tuple[int, int], list[int]] = {}  # (depth, nodes) -> rows drafted together by the slot drafts
        for b, (s, k) in enumerate(zip(seqs, depths)):
            if looked[b]:
                drafts[b] = s.lookup.chain(s.ids[:, -1], lengths[b])
            elif k > 0 and s.drafter is _BATCHED:
                batched.setdefault((k, s.monitor.rows(k)), []).append(b)
            elif k > 0:
                try:
                    drafts[b] = s.drafter.propose(DraftContext(s.ids, s.sampling, k, k + 1, s.gen))
                except Exception as e:  # noqa: BLE001 - one request's drafter must not stop the others
                    self._drop_drafter(s, e)
        for (k, nodes), rows in batched.items():
            try:
                for b, d in zip(rows, self.slot_drafts.propose(rows, [seqs[b].ids[0, -1:] for b in rows], k,
                                                               [seqs[b].sampling for b in rows],
                                                               [seqs[b].gen for b in rows], nodes=nodes,
                                                               top_k=self._tree[1] if self._tree else 1)):
                    drafts[b] = d
            except Exception as e:  # noqa: BLE001 - these requests go on without speculation
                for b in rows:
                    self._drop_drafter(seqs[b], e)
        drafts = [d if d is not None else Draft.root_only(s.ids[:, -1]) for s, d in zip(seqs, drafts)]
        t1 = time.perf_counter()
        B, N = len(seqs), max(d.num_nodes for d in drafts)
        tokens = torch.zeros(B, N, dtype=torch.long, device=dev)
        tokens[:, 0] = torch.cat([d.tokens[0, :1] for d in drafts])
        positions = torch.tensor(self.slots.lengths[:B], dtype=torch.long, device=dev).view(B, 1).repeat(1, N)
        block = torch.eye(N, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # padding sees itself only
        depth_of = []  # each draft's depth (a tree k deep has more nodes than k)
        for b, d in enumerate(drafts):  # per-row work only for drafted rows (few of them under load)
            n = d.num_nodes
            if n == 1:  # a plain row: its root at depth 0
                depth_of.append(0)
                continue
            tokens[b, :n] = d.tokens[0]
            node_depths = tree_depths(d.parents)[0]
            positions[b, :n] += node_depths
            depth_of.append(int(node_depths.max()))
            block[b, :n, :n] = ancestor_matrix(d.parents)[0]
        counts = [d.num_nodes for d in drafts]  # only real nodes run through the linears (forward_mixed)
        chunks = self._chunks(self.max_step_tokens - sum(counts))
        if chunks:
            out, chunk_features = forward_mixed(self.slots, tokens, positions, block,
                                                [(f.cache, ids) for f, ids in chunks], self.feature_layers, counts)
        else:
            out = forward_slots(self.slots, tokens, positions, block, self.feature_layers, counts)
        keeps, news, accepted = [], [], []
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            n = d.num_nodes
            try:
                res = verify(d, out.logits[b: b + 1, :n], s.sampling, s.gen)
            except Exception as e:  # noqa: BLE001 - fails this request only (its row is freed below)
                failed[b] = f"{type(e).__name__}: {e}"
                keeps.append(torch.zeros(1, dtype=torch.long))
                news.append(None)
                accepted.append(0)
                continue
            path = res.path[0]
            path = path[path >= 0]
            keeps.append(path)
            news.append(torch.cat([d.tokens[0, path[1:]], res.next_token.view(1)]).view(1, -1))
            accepted.append(int(res.accept_len[0]))
        self.slots.commit(keeps)
        t2 = time.perf_counter()
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            if s.drafter is not None and b not in failed:  # told of every continuation, drafted or not
                try:
                    feats = out.features[b: b + 1, keeps[b]] if out.features is not None else None
                    if s.drafter is _BATCHED:
                        self.slot_drafts.commit(b, news[b], feats)
                        if s.lookup is not None:
                            s.lookup.commit(news[b])
                    else:
                        s.drafter.commit(news[b], feats)
                except Exception as e:  # noqa: BLE001
                    self._drop_drafter(s, e)
        t3 = time.perf_counter()
        # head forwards per row: a tree k deep costs k, as a chain of k does
        drafted = sum(k for k, lk in zip(depth_of, looked) if not lk)
        # rows catching their head up on a prompt: once per request, not a cost per drafted depth
        catchup = self.slot_drafts.catchup_seconds - caught_up if self.slot_drafts is not None else 0.0
        if not chunks:  # the cost model's unit is a decode forward's (a prefill chunk would skew it)
            self.policy.record_step(t2 - t1, sum(counts), (t1 - t0) + (t3 - t2) - catchup, drafted, B)
        self._verified_at = t3 if not chunks else None
        self.steps += 1
        self.metrics.step(B, queued, sum(1 for d in drafts if d.num_nodes > 1), t3 - t0)
        finished = []
        now = time.perf_counter()
        for b, (s, d) in enumerate(zip(seqs, drafts)):
            if b in failed:
                finished.append((b, "error"))
            else:
                self._emit(b, s, d, depth_of[b], looked[b], accepted[b], news[b], now, finished)
        self._errors = failed
        for row, reason in sorted(finished, reverse=True):
            self._finish(row, reason)
        if chunks:
            self._chunks_done(chunks, chunk_features)

    def _chunks(self, budget: int) -> list:
        """This step's prompt chunks, first admitted first: ``[(fill, ids)]`` within ``budget``
        tokens (at least a quarter of ``max_step_tokens``, so prefill advances under any load)."""
        budget = max(budget, self.max_step_tokens // 4, 1)
        chunks = []
        for fill in self._filling:
            if budget <= 0:
                break
            todo = fill.seq.ids.shape[1] - fill.cache.length
            c = min(todo, budget)
            chunks.append((fill, fill.seq.ids[0, fill.cache.length: fill.cache.length + c]))
            budget -= c
        return chunks

    def _chunks_done(self, chunks: list, outputs: list) -> None:
        """Keep each chunk's features; requests whose prompt is now prefilled start decoding."""
        finished = []
        for (fill, _), (logits, f) in zip(chunks, outputs):
            fill.features.append(f)
            if fill.cache.length == fill.seq.ids.shape[1]:
                self._filling.remove(fill)
                self._start(fill, logits, finished)
        for row, reason in sorted(finished, reverse=True):
            self._finish(row, reason)

    def _prefill_only(self) -> None:
        chunks = self._chunks(self.max_step_tokens)
        empty = torch.zeros(0, 1, dtype=torch.long, device=self.engine.device)
        _, features = forward_mixed(self.slots, empty, empty, None, [(f.cache, ids) for f, ids in chunks],
                                    self.feature_layers)
        self._chunks_done(chunks, features)

    def _emit(self, b: int, s: _Seq, d: Draft, depth_drafted: int, looked: bool, n_acc: int, new: torch.Tensor,
              now: float, finished: list) -> None:
        n_drafted = d.num_nodes - 1
        if looked:  # a prompt-lookup draft: its own figures, not the head's
            self.policy.record_lookup(depth_drafted, n_acc)
        elif s.drafter is not None:  # a tree has more drafts than depth
            self.policy.record(s.monitor, depth_drafted, n_acc, tree=n_drafted > depth_drafted)
        st = s.stats
        st.target_forwards += 1
        st.drafted += n_drafted
        st.accepted += n_acc
        if n_drafted:
            st.speculative_steps += 1
            self.metrics.drafts(n_drafted, n_acc, depth_drafted)
            st.tally.record(depth_drafted, n_acc)
        s.ids = torch.cat([s.ids, new], dim=1)
        r = s.handle.request
        step_tokens = new[0].tolist()[: r.max_new_tokens - s.emitted]
        eos = self.target.eos_token_ids if r.stop_at_eos else ()
        reason = None
        for i, t in enumerate(step_tokens):
            if t in eos:
                step_tokens, reason = step_tokens[: i + 1], "stop"
                break
        s.emitted += len(step_tokens)
        st.new_tokens = s.emitted
        if reason is None and s.emitted >= r.max_new_tokens:
            reason = "length"
        first = s.last_token_at is None
        if first:
            st.ttft_seconds = now - s.handle.submitted
            self.metrics.first_token(st.ttft_seconds)
        self.metrics.tokens(len(step_tokens), first, None if first else now - s.last_token_at)
        s.last_token_at = now
        text = s.detok.push(step_tokens)
        if step_tokens or text:
            s.handle._put(Event(step_tokens, text))
        if reason is not None:
            finished.append((b, reason))


class _Fill:
    """A request whose prompt is being prefilled into its own cache, chunk by chunk."""

    def __init__(self, seq: _Seq, cache):
        self.seq, self.cache = seq, cache
        self.features: list = []  # per chunk [1, c, F, H] (or None without feature layers)


class _Batched:
    """``_Seq.drafter`` of a sequence the engine's :class:`~.drafts.SlotDrafts` drafts for."""

    def __repr__(self):
        return "<slot drafts>"


_BATCHED = _Batched()


class _Off:
    """The monitor of a sequence without a drafter."""

    speculating = False
    tree_nodes = None

    def rows(self, depth):
        return depth + 1

    def acceptance(self, prior):
        return prior


_OFF = _Off()
