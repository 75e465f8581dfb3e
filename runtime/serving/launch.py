"""Start ``specfoundry serve`` in a subprocess on a free loopback port (tests, benchmarks).

    with serve_subprocess(["--target", "smollm2-135m", "--speculator", "ngram"]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")

The server listens on 127.0.0.1 (unless ``args`` names a ``--host``); the context manager waits
for ``GET /health`` to answer 200, yields the base URL (``http://127.0.0.1:PORT``), and stops the
server (SIGTERM, then SIGKILL after ``stop_timeout``) on exit. The server's output goes to a
temporary log file whose tail is in the error raised when it does not come up.
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
    """``GET url/health`` as a dict, or None when the server does not answer 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


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
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    # the server exits if this process dies (unless the caller's env names another parent)
    full_env["SPECFOUNDRY_SERVE_PARENT_PID"] = (env or {}).get("SPECFOUNDRY_SERVE_PARENT_PID", str(os.getpid()))
    last_error = ""
    for _ in range(max(1, attempts)):
        port = free_port(host if host not in ("0.0.0.0", "::") else "127.0.0.1")
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
        logf = open(log, "ab") if log else tempfile.NamedTemporaryFile(prefix="specfoundry-serve-", suffix=".log",
                                                                        delete=False)
        cmd = [python or sys.executable, "-m", "specfoundry.runtime.cli", "serve", *args, "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=full_env)
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
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            logf.close()
            if not log:
                with contextlib.suppress(OSError):
                    os.unlink(logf.name)
    raise RuntimeError(f"no free port after {attempts} attempts:\n{last_error}")
