"""Start ``specfoundry serve`` in a subprocess on a free loopback port (tests, benchmarks).

    with serve_subprocess(["--target", "smollm2-135m", "--speculator", "ngram"]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")

The server listens on 127.0.0.1 (unless ``args`` names a ``--host``); the context manager waits
for ``GET /health`` to answer 200, yields the base URL (``http://127.0.0.1:PORT``), and stops the
server (SIGTERM, then SIGKILL after ``stop_timeout``) on exit. The server's output goes to a
temporary log file whose tail is in the error raised when it does not come up.

:func:`server_subprocess` is the same lifecycle for any HTTP server command that takes a port and
answers ``GET /health`` (the bench's vLLM peer): free port, health wait, bounded stop, optionally
of the server's whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: str, chars: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def health(url: str, timeout: float = 2.0) -> dict | None:
    """``GET url/health`` as a dict (``{}`` for an empty 200 body, as vLLM answers), or None when
    the server does not answer 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            if r.status != 200:
                return None
            body = r.read()
            return json.loads(body) if body.strip() else {}
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """SIGTERM this (child) process when its parent dies (Linux ``PR_SET_PDEATHSIG``; no-op elsewhere)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(proc: subprocess.Popen, stop_timeout: float, group: bool) -> None:
    """SIGTERM, then SIGKILL after ``stop_timeout``; ``group``: to the whole process group (the
    server's workers too), and a final SIGKILL to whatever of the group outlived the leader."""
    import signal

    def send(sig):
        try:
            if group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    if proc.poll() is None:
        send(signal.SIGTERM)
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            proc.wait()
    if group:
        send(signal.SIGKILL)


@contextlib.contextmanager
def server_subprocess(command, *, host: str = "127.0.0.1", timeout: float = 180.0, stop_timeout: float = 10.0,
                      env: dict | None = None, attempts: int = 3, log: str | None = None, own_group: bool = False):
    """Run ``command(port)`` (an argv list for a server listening on ``host:port``); yield its base URL.

    Waits for ``GET /health`` to answer 200 (``timeout`` seconds, model loading included); stops
    the server on exit, errors included (SIGTERM, SIGKILL after ``stop_timeout``). ``env``: extra
    environment variables; ``attempts``: new ports to try when the chosen one was taken meanwhile;
    ``log``: a file for the server's output (kept; default: a temporary file, removed);
    ``own_group``: start the server in its own session and stop its whole process group (servers
    with worker processes), and SIGTERM it if this process dies (Linux)."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    last_error = ""
    for _ in range(max(1, attempts)):
        port = free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        logf = open(log, "ab") if log else tempfile.NamedTemporaryFile(prefix="specfoundry-serve-", suffix=".log",
                                                                        delete=False)
        cmd = [str(c) for c in command(port)]
        extra = {"start_new_session": True, "preexec_fn": _die_with_parent} if own_group else {}
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env, **extra)
        try:
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline and health(url, timeout=1.0) is None:
                time.sleep(0.1)
            if proc.poll() is None and health(url) is not None:
                yield url
                return
            if proc.poll() is None:
                raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s: {' '.join(cmd)}\n"
                                   f"{_tail(logf.name)}")
            last_error = _tail(logf.name)
            if "address already in use" not in last_error.lower():
                raise RuntimeError(f"the server exited with code {proc.returncode}: {' '.join(cmd)}\n{last_error}")
        finally:
            _stop(proc, stop_timeout, own_group)
            logf.close()
            if not log:
                with contextlib.suppress(OSError):
                    os.unlink(logf.name)
    raise RuntimeError(f"no free port after {attempts} attempts:\n{last_error}")


@contextlib.contextmanager
def serve_subprocess(args: list[str], timeout: float = 180.0, stop_timeout: float = 10.0, env: dict | None = None,
                     python: str | None = None, attempts: int = 3, log: str | None = None):
    """Run ``python -m specfoundry.runtime.cli serve *args --port <free port>``; yield its base URL.

    ``timeout``: seconds to wait for /health (model loading included); ``env``: extra environment
    variables; ``attempts``: new ports to try when the chosen one was taken meanwhile; ``log``: a
    file for the server's output (kept; default: a temporary file, removed). The server exits by
    itself if this process dies."""
    host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
    if "--port" in args:
        raise ValueError("serve_subprocess picks the port itself; do not pass --port")
    env = dict(env or {})
    # the server exits if this process dies (unless the caller's env names another parent)
    env.setdefault("SPECFOUNDRY_SERVE_PARENT_PID", str(os.getpid()))
    with server_subprocess(lambda port: [python or sys.executable, "-m", "specfoundry.runtime.cli", "serve", *args,
                                         "--port", str(port)],
                           host=host, timeout=timeout, stop_timeout=stop_timeout, env=env, attempts=attempts,
                           log=log) as url:
        yield url
