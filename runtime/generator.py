"""The speculative generator: propose -> verify -> commit, one sequence at a time.

``SpeculativeGenerator(target, drafter).generate(...)`` returns exactly what the target alone
would produce at T=0 (and the target's distribution when sampling): every token it emits
comes from :func:`~specfoundry.runtime.verify.verify`. ``speculate=False`` runs plain
decoding through the same target path (each step a root-only draft).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from .adaptive import AcceptanceTally, AdaptiveController
from .drafters.base import DraftContext, Drafter
from .sampling import SamplingParams
from .target import TargetModel
from .tree import Draft, ancestor_matrix, tree_depths
from .verify import verify


@dataclass
class GenerationStats:
    tau: float = 0.0  # new tokens per target forward (decode steps only)
    # conditional: P(draft at depth d accepted | depth d-1 accepted), d = 1..max depth
    acceptance_by_position: list[float] = field(default_factory=list)
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


class SpeculativeGenerator:
    """Lossless speculative decoding of one sequence with ``target`` and ``drafter``.

    ``max_depth``/``max_nodes`` cap the draft (default: the drafter's own); ``adaptive``
    lets :class:`AdaptiveController` choose the depth per step from measured acceptance and
    costs (turn it off for reproducible sampling runs with a fixed draft shape).
    """

    def __init__(self, target: TargetModel, drafter: Drafter | None = None, *, max_depth: int | None = None,
                 max_nodes: int | None = None, adaptive: bool = True):
        self.target = target
        self.drafter = drafter
        self.max_depth = max_depth if max_depth is not None else (drafter.default_depth if drafter else 0)
        self.max_nodes = max_nodes if max_nodes is not None else (drafter.default_nodes if drafter else 1)
        self.adaptive = adaptive
        self._control: AdaptiveController | None = None

    # -- public API --------------------------------------------------------------------
    def generate(self, messages: list[dict] | None = None, *, prompt: str | None = None,
                 prompt_ids: list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = 0, speculate: bool = True, stop_at_eos: bool = True) -> GenerationOutput:
        ids: list[int] = []
        stats = None
        prompt_list = self._prompt_ids(messages, prompt, prompt_ids)
        for chunk in self._run(prompt_list, max_new_tokens, SamplingParams(temperature, top_k, top_p), seed,
                               speculate, stop_at_eos):
            ids.extend(chunk.token_ids)
            stats = chunk.stats
        return GenerationOutput(ids, self.target.decode(ids) if ids else "", stats, prompt_list)

    def stream(self, messages: list[dict] | None = None, *, prompt: str | None = None,
               prompt_ids: list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = 0, speculate: bool = True, stop_at_eos: bool = True) -> Iterator[StreamChunk]:
        prompt_list = self._prompt_ids(messages, prompt, prompt_ids)
        yield from self._run(prompt_list, max_new_tokens, SamplingParams(temperature, top_k, top_p), seed,
                             speculate, stop_at_eos)

    # -- internals ---------------------------------------------------------------------
    def _prompt_ids(self, messages, prompt, prompt_ids) -> list[int]:
        given = [x is not None for x in (messages, prompt, prompt_ids)]
        if sum(given) != 1:
            raise ValueError("pass exactly one of messages=, prompt= or prompt_ids=")
        if messages is not None:
            if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
            ids = self.target.encode_chat(messages)
        elif prompt is not None:
            ids = self.target.encode_chat([{"role": "user", "content": prompt}])
        else:
            ids = prompt_ids.view(-1).tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        return [int(i) for i in ids]

    def _run(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, seed, speculate: bool,
             stop_at_eos: bool) -> Iterator[StreamChunk]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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
        while len(emitted) < max_new_tokens:
            root = ids[:, -1]
            t0 = time.perf_counter()
            shape = control.choose(shapes) if drafter is not None else (0, 1)
            depth = shape[0]
            if depth > 0:
                draft = drafter.propose(DraftContext(ids, sampling, depth, shape[1], gen))
            else:
                draft = Draft.root_only(root)
            t1 = time.perf_counter()
            depths = tree_depths(draft.parents)
            mask = ancestor_matrix(draft.parents) if draft.num_nodes > 1 else None
            out = target.forward(draft.tokens, cache, position_ids=cache.length + depths, tree_mask=mask,
                                 feature_layers=feature_layers)
            res = verify(draft, out.logits, sampling, gen)
            path = res.path[0]
            path = path[path >= 0]
            cache.commit(path)
            new = torch.cat([draft.tokens[0, path[1:]], res.next_token.view(1)]).view(1, -1)
            t2 = time.perf_counter()
            if drafter is not None:
                drafter.commit(new, out.features[:, path] if out.features is not None else None)
            t3 = time.perf_counter()

            n_drafted = draft.num_nodes - 1
            n_acc = int(res.accept_len[0])
            depth_drafted = int(depths.max()) if n_drafted else 0
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
            step_tokens = new[0].tolist()[: max_new_tokens - len(emitted)]
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
