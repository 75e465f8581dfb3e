"""Prometheus metrics for the serving engine: the :class:`~.scheduler.NullMetrics` hooks, recorded.

Scope: counters, gauges and histograms on this object's own ``CollectorRegistry`` (never the
process-global one, so several engines or test servers in one process do not collide), and the
Prometheus text rendering the server's ``GET /metrics`` returns. Needs ``prometheus_client``
(the ``serve`` extra).

Names (all prefixed ``specfoundry_``), following vLLM's where one exists:

- ``requests_total{finish_reason}``, ``prompt_tokens_total``, ``generation_tokens_total``
  (every token the engine delivered to a request), ``sequence_steps_total`` (sequences x steps);
- gauges ``batch_size`` (sequences in the last step), ``running`` and ``queue_depth`` (refreshed
  from the engine on every scrape), ``speculating_requests`` (sequences that drafted in the last
  step), ``tau`` (generation tokens / sequence-steps since start: tokens per sequence per
  target forward, 1.0 without speculation);
- ``spec_decode_num_drafts_total`` (speculative sequence-steps), ``spec_decode_num_draft_tokens_total``
  (drafted nodes), ``spec_decode_num_accepted_tokens_total``,
  ``spec_decode_num_accepted_tokens_per_pos_total{position}`` (position 0 = the first drafted
  token; acceptance at position p = accepted_per_pos[p] / drafts that reached depth p+1,
  ``spec_decode_num_drafts_per_pos_total{position}``);
- the server's ``http_responses_total{path,status}`` and ``completions_total{finish_reason}``
  (finish reasons as clients saw them: a stop string is ``stop`` there, while the engine, which
  the server cancels at a stop string, counts it under ``requests_total{finish_reason="cancelled"}``);
- the standard ``process_*`` (``process_resident_memory_bytes``, CPU seconds, open fds),
  ``python_info`` and ``python_gc_*`` series of this process (``process=False`` leaves them out);
- histograms ``time_to_first_token_seconds`` (submission to the first token),
  ``inter_token_latency_seconds`` (per token: the gap between two deliveries to a request divided
  by the tokens in the later one), ``e2e_request_latency_seconds``, ``step_seconds``.

Thread-safety: the hooks run on the engine thread, :meth:`render` on the server's; every
``prometheus_client`` metric is thread-safe, and the two plain integers behind ``tau`` are
updated under a lock.
"""

from __future__ import annotations

import threading

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, GCCollector, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)

PREFIX = "specfoundry_"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class PrometheusMetrics:
    """The engine's metrics hooks backed by ``prometheus_client`` on a private registry.

    ``ServingEngine(..., metrics=PrometheusMetrics())``; ``render()`` gives the exposition text
    (``content_type`` is its media type); ``observe_load(engine.load())`` refreshes the live
    gauges (the server does it on every scrape)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None, process: bool = True):
        self.registry = registry if registry is not None else CollectorRegistry()
        r, p = self.registry, PREFIX
        if process:  # the standard process_* (resident memory, CPU seconds, fds), python_* series
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        self.requests = Counter(p + "requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens delivered to requests", registry=r)
        self.sequence_steps = Counter(p + "sequence_steps", "Sequences taking part in a step, summed over steps",
                                      registry=r)
        self.batch_size = Gauge(p + "batch_size", "Sequences in the last step (0 when idle)", registry=r)
        self.running = Gauge(p + "running", "Requests holding a slot", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a slot", registry=r)
        self.speculating = Gauge(p + "speculating_requests", "Sequences that drafted in the last step", registry=r)
        self.tau = Gauge(p + "tau", "Generation tokens per sequence-step since start (mean accepted length + 1)",
                         registry=r)
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Speculative sequence-steps (drafts verified)",
                                  registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Drafted tokens (tree nodes)",
                                        registry=r)
        self.num_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Accepted drafted tokens", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted drafted tokens by position (0 = first drafted token)",
                                        ["position"], registry=r)
        self.drafts_per_pos = Counter(p + "spec_decode_num_drafts_per_pos",
                                      "Drafts reaching each position (the denominator of acceptance by position)",
                                      ["position"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Submission to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Seconds per token between deliveries",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Submission to finish", buckets=E2E_BUCKETS,
                             registry=r)
        self.step_seconds = Histogram(p + "step_seconds", "Seconds per engine step", buckets=STEP_BUCKETS,
                                      registry=r)
        # the HTTP side (the server records these; an embedding without HTTP leaves them at 0)
        self.http_responses = Counter(p + "http_responses", "HTTP responses by path and status code",
                                      ["path", "status"], registry=r)
        self.completions = Counter(p + "completions", "Completions as clients saw them, by finish reason (a stop "
                                   "string counts as stop, a client gone as cancelled)", ["finish_reason"], registry=r)
        self._lock = threading.Lock()
        self._gen_tokens = 0
        self._seq_steps = 0

    # -- the engine's hooks (engine thread) ----------------------------------------------------
    def step(self, batch: int, queue_depth: int, speculating: int, seconds: float) -> None:
        self.batch_size.set(batch)
        self.running.set(batch)
        self.queue_depth.set(queue_depth)
        self.speculating.set(speculating)
        self.sequence_steps.inc(batch)
        self.step_seconds.observe(seconds)
        with self._lock:
            self._seq_steps += batch

    def drafts(self, drafted: int, accepted: int, depth: int) -> None:
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted.inc(accepted)
        for pos in range(depth):
            self.drafts_per_pos.labels(position=str(pos)).inc()
            if pos < accepted:
                self.accepted_per_pos.labels(position=str(pos)).inc()
            else:  # keep the series present (at 0) for every drafted position
                self.accepted_per_pos.labels(position=str(pos))

    def tokens(self, n: int, first: bool, seconds_since_last: float | None) -> None:
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if not first and seconds_since_last is not None:
            per_token = seconds_since_last / n
            for _ in range(n):
                self.itl.observe(per_token)
        with self._lock:
            self._gen_tokens += n
            if self._seq_steps:
                self.tau.set(self._gen_tokens / self._seq_steps)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def finished(self, reason: str, prompt_tokens: int, stats) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if stats is not None:
            self.e2e.observe(stats.seconds)

    # -- the server's side ---------------------------------------------------------------------
    def observe_load(self, load: dict) -> None:
        """Refresh the live gauges from ``ServingEngine.load()``; an idle engine shows 0."""
        self.running.set(load.get("running", 0))
        self.queue_depth.set(load.get("waiting", 0))
        if not load.get("running", 0):
            self.batch_size.set(0)
            self.speculating.set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
