"""``specfoundry serve``: the OpenAI-compatible server (:mod:`.server`) on uvicorn.

Registered through the ``specfoundry.commands`` entry-point group. Loads the target and drafter
with the runtime's loaders (``load_target``/``load_drafter``), builds a
:class:`~.scheduler.ServingEngine` with :class:`~.metrics.PrometheusMetrics`, prints one line with
the URL once it accepts connections, and serves until SIGINT/SIGTERM.

Threads: the engine's steps run on the main thread, which loaded the model (all of the process's
torch work on one thread: see :class:`~.scheduler.ServingEngine` on OpenMP pools, 2x measured);
uvicorn's event loop runs on a thread of its own and the main thread takes the signals.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PARENT_ENV = "SPECFOUNDRY_SERVE_PARENT_PID"  # set by launch.serve_subprocess: exit when that process is gone
# oneDNN's primitive cache and ideep's LRU cache of the packed-weight kernels are keyed by shape and
# hold 1024 entries each by default, ~250-400 kB per entry. Every row count of a product was a shape
# (each prompt length, each batch), so the memory grew for as long as new counts came (+750 MB in a
# 10-minute soak); capped at 64, shapes churned: a primitive created on most steps (+20% on the
# products, thirteenth session). The engine now pads products above 32 rows to 8 sizes per octave
# (``engine.row_bucket``: ~72 per weight), so 512 entries hold every shape a server uses.
NATIVE_CACHE_CAPACITY = 512
NATIVE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_native_caches(capacity: int = NATIVE_CACHE_CAPACITY, env=os.environ) -> dict:
    """Cap the shape-keyed kernel caches (see :data:`NATIVE_CACHES`) unless the user set them; both
    are read when first used, so this must run before the first oneDNN operation. Returns the values."""
    for name in NATIVE_CACHES:
        env.setdefault(name, str(capacity))
    return {name: env[name] for name in NATIVE_CACHES}


def register(subparsers) -> None:
    from ..cli import DTYPES

    p = subparsers.add_parser("serve", help="OpenAI-compatible server with batched speculative decoding")
    p.add_argument("--target", default="smollm2-135m", help="built-in target name or local HF directory")
    p.add_argument("--speculator", default="ngram",
                   help="speculator checkpoint dir (e.g. runs/eagle3-smollm2-135m/speculator), a drafter type "
                        "(ngram, ...), a draft-model dir, or 'none' for plain decoding")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES),
                   help="auto (default): the dtype whose plain decoding is fastest here, measured at load")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; beyond it: 429")
    p.add_argument("--max-context", type=int, default=None,
                   help="prompt + new tokens per request (default: the model's context, at most 4096)")
    p.add_argument("--max-depth", type=int, default=None, help="max draft depth (default: the drafter's)")
    p.add_argument("--prompt-lookup", type=int, default=2, metavar="N",
                   help="draft the prompt-lookup continuation whenever a request's last N tokens occurred "
                        "earlier in its prompt + output, else the speculator's draft (default 2, measured faster "
                        "with every trained head; 0: off)")
    p.add_argument("--speculation-table", default=None,
                   help="batch-size ranges -> draft depth, overriding the cost model, e.g. '1-4:3,5-8:1,9-:0'")
    p.add_argument("--max-step-tokens", type=int, default=512,
                   help="tokens per forward: prompts are prefilled in chunks beside the decoding rows")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_serve)


def build_engine(args):
    """(engine, metrics, model name) from parsed ``serve`` arguments."""
    import torch

    from ..cli import DTYPES
    from ..drafters import load_drafter
    from ..drafters.lookup import with_lookup
    from ..models import load_target
    from .metrics import PrometheusMetrics
    from .scheduler import ServingEngine

    bound_native_caches()
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    target = load_target(args.target, dtype=DTYPES[args.dtype], backend="engine")
    spec = args.speculator
    drafter = None if spec in (None, "", "none") else load_drafter(spec, target=target)
    drafter = with_lookup(drafter, args.prompt_lookup)
    metrics = PrometheusMetrics()
    engine = ServingEngine(target, drafter, max_batch=args.max_batch, max_queue=args.max_queue,
                           max_context=args.max_context, max_depth=args.max_depth,
                           speculation_table=args.speculation_table, metrics=metrics,
                           max_step_tokens=args.max_step_tokens, background=False)
    return engine, metrics, args.model_name or target.name


def _serve(args) -> int:
    import uvicorn

    from .server import create_app

    engine, metrics, name = build_engine(args)
    app = create_app(engine, name, metrics)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=args.log_level in ("info", "debug"))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # end running requests now ("cancelled": streams get an error chunk), so the graceful
            # shutdown does not wait for long generations; the engine's loop then returns on main
            engine.close()
            super().handle_exit(sig, frame)

    server = Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"

    def announce():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            spec = "none" if engine.drafter is None else args.speculator
            print(f"specfoundry serve: {url}/v1 ready (model {name!r}, speculator {spec}, "
                  f"max batch {engine.max_batch}, context {engine.max_context})", flush=True)

    threading.Thread(target=announce, name="serve-announce", daemon=True).start()
    parent = os.environ.get(PARENT_ENV)
    if parent and parent.isdigit():  # started by serve_subprocess: do not outlive it

        def watch_parent():
            while os.getppid() == int(parent) and not server.should_exit:
                time.sleep(1.0)
            server.should_exit = True

        threading.Thread(target=watch_parent, name="serve-parent", daemon=True).start()
    failure: list[BaseException] = []

    def http():
        try:
            server.run()  # off the main thread uvicorn installs no signal handlers: main takes them below
        except BaseException as e:  # noqa: BLE001 - reported on main after the engine stops
            failure.append(e)
        finally:
            engine.close()  # the engine's loop on main returns

    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    web = threading.Thread(target=http, name="serve-http")
    web.start()
    try:
        engine.run()
    finally:
        server.should_exit = True
        engine.close()
        web.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure:
        raise failure[0]
    if not server.started:
        print(f"specfoundry serve: could not listen on {url}", file=sys.stderr)
        return 1
    return 0
