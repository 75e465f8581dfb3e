"""Data generation for training: the target writes its training responses (and, through
:mod:`.prompts`, its Magpie prompts) by batched generation.

Scope:

- :class:`ChatFormat`: the target's chat template as token ids — the templated prompt, the
  user-turn prefix Magpie feeds the model, and the tokens that end a turn — through the runtime's
  one chat encoder (:mod:`specfoundry.runtime.chat`: content is encoded as text). Targets without
  a tokenizer (tiny test models) get a fixed toy template over raw ids.
- :func:`generate_batched`: batched generation with a frozen target (greedy or
  temperature/top-k/top-p sampling, each prompt drawing from its own random stream): on the
  runtime's engine with continuous batching in the serving slots
  (:mod:`specfoundry.runtime.serving.slots`: a finished prompt's slot goes to the next prompt,
  prefilled in the same forward) where the target decodes on it, else static left-padded batches
  on the HF model. Tokens are drawn by the runtime's batched sampler
  (:func:`specfoundry.runtime.sampling.sample_batch`: the distribution of
  :func:`~specfoundry.runtime.sampling.probs_from_logits` without a full-vocabulary sort per step).
  It can also hand back the target's states of every position (``state_layers``), computed by
  the generation's own forwards.

Self-distillation (the target answering the training prompts, cached) is :mod:`.distill`.
Imports :mod:`.datacache` only (never :mod:`.data`, :mod:`.prompts` or :mod:`.distill`): the data
modules form no import cycle (data -> distill / prompts -> generation -> datacache).
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import torch

from specfoundry.runtime.chat import encode_chat, encode_text
from specfoundry.runtime.target import hf_cache_kw
from specfoundry.runtime.sampling import SamplingParams, sample_batch

from .datacache import GenStats, resolve_dtype, stable_hash

__all__ = ["ChatFormat", "model_in_dtype", "generation_model", "generate_batched"]

_SENTINEL = "\u2063SPECFOUNDRY\u2063"  # invisible separator: cannot clash with real text



# ---------------------------------------------------------------------------------------------
# chat template as token ids
# ---------------------------------------------------------------------------------------------


class ChatFormat:
    """A target's chat template as token ids.

    With a tokenizer that has a chat template, the user-turn prefix and the end-of-turn token are
    found by rendering a sentinel message and cutting around it, so any template works. Without a
    tokenizer (tiny random test models) a toy template over raw ids is used: text is
    whitespace-separated integer ids (``decode`` writes that form, so generated prompts round-trip
    exactly), other text is mapped byte-wise into the vocabulary; ``USER``/``END``/``ASSISTANT``
    are ids 1/2/3.
    """

    TOY_USER, TOY_END, TOY_ASSISTANT, TOY_FIRST_FREE = 1, 2, 3, 4

    def __init__(self, target):
        self.target = target
        self.tokenizer = target.tokenizer
        self.has_template = bool(self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None))
        if self.tokenizer is not None and not self.has_template:
            raise ValueError("the target's tokenizer has no chat template; self-distillation needs one")
        self.vocab_size = target.vocab_size
        self._end_of_user = self._end_of_assistant = None  # the template's end-of-turn tokens
        if self.has_template:
            self._end_of_user = self._token_after_sentinel([{"role": "user", "content": _SENTINEL}])
            self._end_of_assistant = self._token_after_sentinel(
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}])

    # -- helpers -----------------------------------------------------------------------------
    def _token_after_sentinel(self, messages) -> int | None:
        # template text only (what follows the last message's content): control strings count
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        after = text.split(_SENTINEL, 1)[1]
        ids = list(self.tokenizer(after, add_special_tokens=False)["input_ids"])
        return ids[0] if ids else None

    def _toy_encode(self, text: str) -> list[int]:
        parts = text.split()
        if parts and all(p.isdigit() and int(p) < self.vocab_size for p in parts):
            return [int(p) for p in parts]
        span = self.vocab_size - self.TOY_FIRST_FREE
        return [self.TOY_FIRST_FREE + b % span for b in text.encode()]

    # -- public ------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return int(self.tokenizer.pad_token_id)
        eos = sorted(self.target.eos_token_ids)
        return int(eos[0]) if eos else 0

    def prompt_ids(self, prompt: str, system: str | None = None) -> list[int]:
        """The templated single-user-turn conversation, ending with the assistant header."""
        if not self.has_template:
            return [self.TOY_USER, *self._toy_encode(prompt), self.TOY_END, self.TOY_ASSISTANT]
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return encode_chat(self.tokenizer, msgs, add_generation_prompt=True)

    def user_prefix_ids(self, system: str | None = None) -> list[int]:
        """Everything before the user's text in a templated conversation (the Magpie prefix).
        ``system=None`` keeps the template's default system message, if it has one."""
        if not self.has_template:
            pre = [self.TOY_USER]
            if system:
                pre = [self.TOY_USER, *self._toy_encode(system), self.TOY_END, self.TOY_USER]
            return pre
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _SENTINEL}]
        return encode_chat(self.tokenizer, msgs, add_generation_prompt=False, stop_before_content_of=len(msgs) - 1)

    def _stop_ids(self, end_of_turn: int | None) -> list[int]:
        ids = set(self.target.eos_token_ids)
        if not self.has_template:
            ids.add(self.TOY_END)
        elif end_of_turn is not None:
            ids.add(end_of_turn)
        return sorted(ids)

    @property
    def user_stop_ids(self) -> list[int]:
        """Tokens that end a user turn (Magpie stops there)."""
        return self._stop_ids(self._end_of_user)

    @property
    def assistant_stop_ids(self) -> list[int]:
        """Tokens that end an assistant turn (self-distillation stops there)."""
        return self._stop_ids(self._end_of_assistant)

    def encode_text(self, text: str) -> list[int]:
        """Plain text -> ids, no special tokens (for continuing a templated prefix); control
        strings in ``text`` stay text."""
        return encode_text(self.tokenizer, text) if self.has_template else self._toy_encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        if not self.has_template:
            return " ".join(str(int(i)) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def template_id(self) -> str:
        """Hash of what determines the token ids (for cache keys)."""
        if not self.has_template:
            return "toy-v1"
        return stable_hash(self.tokenizer.chat_template, len(self.tokenizer), self.prompt_ids("x"))[:16]


# ---------------------------------------------------------------------------------------------
# batched generation
# ---------------------------------------------------------------------------------------------


def model_in_dtype(target, dtype) -> torch.nn.Module:
    """The target's HF model in ``dtype``: the model itself when it already is, else a cast copy
    (casting in place and back would lose the fp32 weights)."""
    dtype = resolve_dtype(dtype)
    if dtype is None or dtype == target.dtype:
        return target.model
    cache = getattr(target, "_specfoundry_casts", None)
    if cache is None:
        cache = target._specfoundry_casts = {}
    if dtype not in cache:
        cache.clear()  # keep at most one extra copy alive
        cache[dtype] = copy.deepcopy(target.model).to(dtype).eval()
    return cache[dtype]


def generation_model(target, dtype):
    """What batched generation runs in ``dtype``: the runtime's engine
    (:class:`~specfoundry.runtime.engine.LlamaEngine`) when the target decodes on it (the target's
    own engine when the dtype matches, else one over the cast copy), otherwise the HF model."""
    from specfoundry.runtime.engine import LlamaEngine

    model = model_in_dtype(target, dtype)
    if getattr(target, "backend", "hf") != "engine":
        return model
    if model is target.model:
        return target._engine()
    eng = model.__dict__.get("_specfoundry_engine")
    if eng is None:
        eng = model.__dict__["_specfoundry_engine"] = LlamaEngine(model)
    return eng


def _device(model) -> torch.device:
    """Where a generation model (an engine or a HF model) runs."""
    from specfoundry.runtime.engine import LlamaEngine

    return model.device if isinstance(model, LlamaEngine) else next(model.parameters()).device


def row_streams(seed: int, count: int) -> list[torch.Generator]:
    """One random stream per prompt (prompt ``i`` of a call seeded ``seed``): a prompt's sampled
    tokens depend on its own stream only, never on which batch or slot it ran in."""
    return [torch.Generator().manual_seed((int(seed) * 1_000_003 + i) % (1 << 63)) for i in range(count)]


def _next_tokens(logits: torch.Tensor, params: SamplingParams, streams: list[torch.Generator] | None,
                 rows: list[int], n_done: list[int], stop: torch.Tensor, min_new_tokens: int) -> torch.Tensor:
    """One token per row of ``logits`` ``[R, V]``; row ``r`` belongs to prompt ``rows[r]``, which has
    ``n_done[r]`` tokens so far (its stop tokens are banned until ``min_new_tokens``); sampled rows
    draw one uniform from their prompt's stream; a prompt whose stream is None is answered greedily."""
    logits = logits.float()
    early = [r for r, n in enumerate(n_done) if n < min_new_tokens]
    if early and stop.numel():
        logits[torch.tensor(early, device=logits.device)[:, None], stop[None, :]] = float("-inf")
    if params.greedy:
        return sample_batch(logits, params, None)
    drawn = [r for r, i in enumerate(rows) if streams[i] is not None]
    u = torch.cat([torch.rand(1, generator=streams[rows[r]], dtype=torch.float64) for r in drawn]) if drawn else None
    if len(drawn) == len(rows):
        return sample_batch(logits, params, None, u)
    tok = logits.argmax(-1)  # the greedy rows of a mix (what sample_batch gives at temperature 0)
    if drawn:
        idx = torch.tensor(drawn, device=logits.device)
        tok[idx] = sample_batch(logits[idx], params, None, u)
    return tok


@torch.no_grad()
def _generate_static(model, prompts: list[list[int]], rows: list[int], *, max_new_tokens: int, params: SamplingParams,
                     stop: torch.Tensor, min_new_tokens: int, pad_id: int, streams) -> tuple[list[list[int]], list[bool]]:
    """One left-padded batch on a HF model (``rows``: each prompt's index into ``streams``); rows
    that finish are dropped from the cache."""
    from transformers import DynamicCache

    dev = _device(model)
    B = len(prompts)
    S = max(len(p) for p in prompts)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token sits at column S-1
        ids[i, S - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, S - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)

    def forward(x, m, p):
        # the LM head on the last position only (over the whole prompt it would cost as much as
        # several layers), applied to a contiguous [B, H] matrix: HF's logits_to_keep=1 hands it
        # a strided [B, 1, H] view that CPU bf16 runs as a batched matmul over B copies of the
        # weight (measured: 2.7 GB copied per batch of 48, ~1.7 s)
        out = model.model(input_ids=x, attention_mask=m, position_ids=p, use_cache=True, **hf_cache_kw(cache))
        return model.lm_head(out.last_hidden_state[:, -1].contiguous())

    logits = forward(ids, mask, pos)
    next_pos = pos[:, -1] + 1
    active = list(range(B))
    gen: list[list[int]] = [[] for _ in range(B)]
    finished = [False] * B
    for step in range(max_new_tokens):
        tok = _next_tokens(logits, params, streams, [rows[a] for a in active], [step] * len(active), stop,
                           min_new_tokens)
        for row, t in zip(active, tok.tolist()):
            gen[row].append(t)
        done = torch.isin(tok, stop) if stop.numel() else torch.zeros_like(tok, dtype=torch.bool)
        for row, d in zip(active, done.tolist()):
            finished[row] = finished[row] or d
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if bool(done.any()):
            # drop finished rows: later steps only pay for sequences still generating
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            mask, tok, next_pos = mask[keep], tok[keep], next_pos[keep]
            active = [active[k] for k in keep.tolist()]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = forward(tok[:, None], mask, next_pos[:, None])
        next_pos = next_pos + 1
    return gen, finished


@torch.no_grad()
def _generate_continuous(engine, prompts: list[list[int]], order: list[int], *, slots: int, max_new_tokens: int,
                         params: SamplingParams, stop: torch.Tensor, min_new_tokens: int, streams,
                         on_done, state_layers: tuple[int, ...] = (), on_states=None
                         ) -> tuple[list[list[int]], list[bool]]:
    """Continuous batching on the engine (the serving slots, :mod:`specfoundry.runtime.serving.slots`):
    up to ``slots`` prompts generate at once, and a prompt that finishes hands its slot to the next
    one of ``order``, whose prompt is prefilled in the same forward as the decode rows (a static
    batch instead shrinks as its rows finish: its last steps run a few rows for the cost of many).
    ``on_done(i, new_tokens)`` is called as prompt ``i`` finishes.

    ``state_layers`` (with ``on_states``): the forwards also return the target's states at those
    hidden-state indices, and ``on_states(i, states)`` gets prompt ``i``'s ``[len(prompt) + new, F, H]``
    (every position, prompt and answer) once it is complete: a finished row stays one more forward,
    fed its last token like any decode row, for that token's states (the token drawn after it is dropped)."""
    from specfoundry.runtime.serving.slots import SlotCache, forward_mixed

    cache = SlotCache(engine, slots, max(len(p) for p in prompts) + max_new_tokens)
    queue = list(reversed(order))
    gen: list[list[int]] = [[] for _ in prompts]
    finished = [False] * len(prompts)
    rows: list[int] = []  # prompt index per active slot row
    keep = bool(state_layers)
    states: dict[int, list[torch.Tensor]] = {}  # prompt -> its states so far, position order
    closing: set[int] = set()  # prompts done generating, in the cache for their last token's states
    one = torch.zeros(1, dtype=torch.long, device=engine.device)
    while queue or rows:
        joining = []
        while queue and len(rows) + len(joining) < slots:
            i = queue.pop()
            joining.append((i, engine.new_cache(batch=1, capacity=len(prompts[i]))))
        B = len(rows)
        last = torch.tensor([[gen[i][-1]] for i in rows], dtype=torch.long).view(B, 1)
        pos = torch.tensor([[len(prompts[i]) + len(gen[i]) - 1] for i in rows], dtype=torch.long).view(B, 1)
        dec, outs = forward_mixed(cache, last, pos, None,
                                  [(pc, torch.tensor(prompts[i], dtype=torch.long)) for i, pc in joining],
                                  state_layers)
        if B:
            cache.commit([one] * B)
        if keep:
            # one device-to-host copy per forward; each row keeps a view of its position
            step = dec.features[:, 0].cpu() if B else None
            for r, i in enumerate(rows):
                states[i].append(step[r : r + 1])
            for (i, _), (_, f) in zip(joining, outs):
                states[i] = [f[0].cpu()]
        for i, pc in joining:
            cache.add(pc)
            rows.append(i)
        logits = torch.cat(([dec.logits[:, 0]] if B else []) + [lg[None] for lg, _ in outs])
        # (a closing row's token is drawn with the others and dropped: its prompt is done)
        tok = _next_tokens(logits, params, streams, rows, [len(gen[i]) for i in rows], stop, min_new_tokens)
        done = torch.isin(tok, stop).tolist() if stop.numel() else [False] * len(rows)
        leaving, now_closing = [], set()
        for r, (i, t, d) in enumerate(zip(rows, tok.tolist(), done)):
            if i in closing:  # its last token's states came with this forward
                on_states(i, torch.cat(states.pop(i)))
                leaving.append(r)
                continue
            gen[i].append(t)
            finished[i] = d
            if d or len(gen[i]) >= max_new_tokens:
                on_done(i, len(gen[i]))
                if keep:
                    now_closing.add(i)
                else:
                    leaving.append(r)
        closing = now_closing
        for r in reversed(leaving):  # highest row first: the row moved into r is never one that leaves
            moved = cache.remove(r)
            rows[r] = rows[moved] if moved is not None else rows[r]
            rows.pop()
    return gen, finished


def generate_batched(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                     top_p: float = 1.0, top_k: int = 0, stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
                     batch_size: int = 32, pad_id: int = 0, seed: int = 0, progress: bool | str = False,
                     stats: GenStats | None = None, sampled: Sequence[bool] | None = None,
                     state_layers: Sequence[int] = (), on_states=None) -> tuple[list[list[int]], list[bool]]:
    """Continue each token-id prompt; returns ``(new_ids, finished)`` in input order.

    ``model``: a :class:`~specfoundry.runtime.engine.LlamaEngine` (see :func:`generation_model`),
    which generates with continuous batching in ``batch_size`` slots, or a HF causal LM (static
    left-padded batches of ``batch_size``, finished rows dropped).
    ``new_ids[i]`` includes the stop token when one was produced (``finished[i]`` True). Prompts
    are sorted by length so batches and slots waste little; sampling draws prompt ``i``'s tokens
    from its own stream (:func:`row_streams` of ``seed``), so a call is reproducible for the same
    inputs and a prompt's tokens do not depend on the batch it ran in (only on the logits, whose
    low-order bits can).
    ``sampled`` (with ``temperature > 0``): per prompt, whether it samples; the others are greedy
    (a sampled prompt's tokens are the same as in a call where every prompt samples).
    ``stats`` (optional) accumulates token counts and time.
    ``state_layers`` / ``on_states`` (the engine only): ``on_states(i, states)`` receives prompt ``i``'s
    target states at those hidden-state indices for every position of prompt + answer
    (``[len(prompt) + len(new_ids[i]), F, H]``), computed by the generation's own forwards, so that
    training needs no capture pass over them (see :func:`_generate_continuous`).
    """
    from tqdm.auto import tqdm

    from specfoundry.runtime.engine import LlamaEngine

    prompts = [list(map(int, p)) for p in prompts]
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token")
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    params = SamplingParams(temperature, top_k or None, top_p)  # top_k 0: no top-k cut
    streams = row_streams(seed, len(prompts)) if temperature > 0 else None
    if streams is not None and sampled is not None:
        if len(sampled) != len(prompts):
            raise ValueError(f"sampled has {len(sampled)} entries for {len(prompts)} prompts")
        streams = [g if s else None for g, s in zip(streams, sampled)]
    stop = torch.tensor(sorted(set(int(s) for s in stop_ids)), dtype=torch.long, device=_device(model))
    local = GenStats()
    bar = tqdm(total=len(prompts), desc=progress if isinstance(progress, str) else "generate", unit="seq",
               disable=not progress, leave=False)
    t0 = time.perf_counter()
    kw = dict(max_new_tokens=max_new_tokens, params=params, stop=stop, min_new_tokens=min_new_tokens, streams=streams)

    def done(i: int, n_new: int) -> None:
        local.prompt_tokens += len(prompts[i])
        local.new_tokens += n_new
        local.prompts += 1
        bar.update(1)
        bar.set_postfix_str(f"{local.new_tokens / (time.perf_counter() - t0):.0f} new tok/s", refresh=False)

    if state_layers and (on_states is None or not isinstance(model, LlamaEngine)):
        raise ValueError("state_layers need on_states and a model on the runtime's engine (generation_model)")
    if isinstance(model, LlamaEngine):
        results, fin = _generate_continuous(model, prompts, order, slots=batch_size, on_done=done,
                                            state_layers=tuple(int(i) for i in state_layers), on_states=on_states, **kw)
    else:
        results, fin = [[] for _ in prompts], [False] * len(prompts)
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            gen, ended = _generate_static(model, [prompts[i] for i in idx], idx, pad_id=pad_id, **kw)
            for i, ids, d in zip(idx, gen, ended):
                results[i], fin[i] = ids, d
                done(i, len(ids))
    bar.close()
    local.seconds = time.perf_counter() - t0
    if stats is not None:
        stats.add(local)
    return results, fin  # type: ignore[return-value]
