"""The request side of the serving engine: what a caller submits and what it gets back.

Scope: :class:`Request` (one generation request), :class:`Event` (what a request receives per
step), :class:`RequestStats` (its counters, reported on the last event), :class:`RequestHandle`
(a submitted request: iterate it, blocking or with asyncio, or cancel it) and :class:`QueueFull`.
The engine that fills the handles is :class:`~.scheduler.ServingEngine` (which re-exports these).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from ..adaptive import AcceptanceTally

__all__ = ["Event", "QueueFull", "Request", "RequestHandle", "RequestStats"]


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: retry later (the server answers 429)."""


@dataclass
class Request:
    """One generation request (validated by :meth:`ServingEngine.submit`)."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    speculate: bool = True
    stop_at_eos: bool = True


@dataclass
class Event:
    """What a request receives per step: new tokens and their text; ``finish_reason`` is set on
    the last event ("stop": an end-of-sequence token, "length": max_new_tokens, "cancelled",
    "error": see ``error``)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    stats: dict | None = None  # on the last event: tau, acceptance by position, timings


@dataclass
class RequestStats:
    new_tokens: int = 0
    target_forwards: int = 0  # steps this request took part in
    drafted: int = 0
    accepted: int = 0
    # conditional per-depth counts, the same definition as everywhere (runtime/tau.py)
    tally: AcceptanceTally = field(default_factory=lambda: AcceptanceTally(0))
    queued_seconds: float = 0.0
    ttft_seconds: float = 0.0
    seconds: float = 0.0
    speculative_steps: int = 0

    def as_dict(self) -> dict:
        tau = self.new_tokens / self.target_forwards if self.target_forwards else 0.0
        return {"tau": tau, "acceptance_by_position": self.tally.observed(), "tried": self.tally.tried[1:],
                "passed": self.tally.passed[1:], "target_forwards": self.target_forwards,
                "drafted": self.drafted, "accepted": self.accepted, "speculative_steps": self.speculative_steps,
                "new_tokens": self.new_tokens, "queued_seconds": self.queued_seconds,
                "ttft_seconds": self.ttft_seconds, "seconds": self.seconds}


class RequestHandle:
    """A submitted request: iterate it (blocking) or ``async for`` over :meth:`aiter` for its
    events; :meth:`cancel` frees its slot at the next step boundary."""

    def __init__(self, rid: int, request: Request, loop: asyncio.AbstractEventLoop | None):
        self.id = rid
        self.request = request
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self._loop = loop
        self._q: queue.Queue | asyncio.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.submitted = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def _put(self, event: Event) -> None:
        if event.finish_reason is not None:
            self.finished.set()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._q.put_nowait, event)
            except RuntimeError:  # the caller's event loop is gone: nobody is listening
                self.cancelled.set()
        else:
            self._q.put(event)

    def __iter__(self):
        if self._loop is not None:
            raise RuntimeError("this handle was submitted for asyncio: use `async for ev in handle.aiter()`")
        while True:
            ev = self._q.get()
            yield ev
            if ev.finish_reason is not None:
                return

    async def aiter(self):
        if self._loop is None:
            raise RuntimeError("this handle was submitted without an event loop: iterate it directly")
        while True:
            ev = await self._q.get()
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, Event]:
        """Block until done: (all token ids, all text, the last event)."""
        ids, text, last = [], [], None
        for ev in self:
            ids += ev.token_ids
            text.append(ev.text)
            last = ev
        return ids, "".join(text), last
