"""``specfoundry bench-serve --peers vllm`` without vLLM: the peer's code path, end to end.

A fake ``.venv-vllm`` (``SPECFOUNDRY_VLLM_VENV``) whose ``bin/python`` answers ``import vllm`` and,
for ``-m vllm.entrypoints.openai.api_server ...``, runs a small stdlib HTTP server that speaks the
part of vLLM's OpenAI API the bench uses (``/health`` with an empty 200 body, ``/v1/models``,
streamed ``/v1/chat/completions`` with a usage chunk, ``/metrics`` spec-decode counters) and
starts a child "engine core" process, as vLLM does. It records its command line, environment,
the request bodies and its pids, so the tests check what the bench asks of vLLM (same target
directory, dtype, max batch, threads, exported head and depth; T=0; no field vLLM does not
know), the rows and τ it reports, and that every process of the peer is gone afterwards, errors
included. Our own server runs for real beside it (tiny random Llama + a random-init EAGLE-3
head). What this does not test: vLLM itself (``make check-vllm`` and the real run do).
"""

import argparse
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

FAKE_VLLM = r'''
import json, math, os, subprocess, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"], argv
def opt(name):
    return argv[argv.index(name) + 1] if name in argv else None
model = opt("--model")
spec = json.loads(opt("--speculative-config") or "null")
record = os.environ["FAKE_VLLM_RECORD"] + (".on" if spec else ".off") + ".json"
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the "engine core"
state = {"argv": argv, "pid": os.getpid(), "worker_pid": worker.pid, "bodies": [],
         "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                "VLLM_CPU_KVCACHE_SPACE")}}
counters = {"drafts": 0, "accepted": 0, "drafted": 0}
lock = threading.Lock()  # requests are handled in threads
def dump():
    with lock, open(record + ".tmp", "w") as f:
        json.dump(state, f)
        f.close()
        os.replace(record + ".tmp", record)
dump()
if os.environ.get("FAKE_VLLM_FAIL"):
    print("fake vLLM: startup failed on purpose", flush=True)
    sys.exit(3)

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def send(self, code, body=b"", ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/health":
            self.send(200)
        elif self.path == "/v1/models":
            self.send(200, json.dumps({"object": "list", "data": [{"id": model}]}).encode())
        elif self.path == "/metrics":
            lines = [f'vllm:spec_decode_num_{k}_total{{engine="0"}} {float(v)}' for k, v in
                     (("drafts", counters["drafts"]), ("draft_tokens", counters["drafted"]),
                      ("accepted_tokens", counters["accepted"]))] if spec else []
            self.send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
        else:
            self.send(404)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = int(body["max_tokens"])
        with lock:
            state["bodies"].append(body)
            if spec:  # two tokens per step after the prefill step
                d = math.ceil((n - 1) / 2)
                counters["drafts"] += d
                counters["accepted"] += (n - 1) - d
                counters["drafted"] += d * spec["num_speculative_tokens"]
        dump()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        def ev(obj):
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()
        ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for _ in range(n):
            ev({"choices": [{"index": 0, "delta": {"content": "x"}}]})
        ev({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})
        self.wfile.write(b"data: [DONE]\n\n")

ThreadingHTTPServer((opt("--host"), int(opt("--port"))), H).serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _gone(*pids: int, wait: float = 10.0) -> bool:
    deadline = time.monotonic() + wait
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer, and a random-init EAGLE-3 head for it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specfoundry.runtime import load_target
    from specfoundry.runtime.models import builtin_model_dir
    from specfoundry.runtime.speculators import Eagle3Head, save_speculator

    try:
        tok = AutoTokenizer.from_pretrained(builtin_model_dir("smollm2-135m"))
    except Exception as e:  # pragma: no cover - no cached target
        pytest.skip(f"the SmolLM2 tokenizer is not available: {e}")
    root = tmp_path_factory.mktemp("bench_serve_vllm")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.5, eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    target = load_target(str(root / "target"))
    save_speculator(Eagle3Head.from_target(target, draft_vocab_size=64, feature_layers=[1, 2, 3]), root / "head", target)
    return root / "target", root / "head"


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    py = tmp_path / "fake-venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0.fake; exit 0; fi\n'
                  f'exec "{sys.executable}" "{script}" "$@"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record"
    monkeypatch.setenv("SPECFOUNDRY_VLLM_VENV", str(py.parent.parent))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return record


def _args(*argv):
    from specfoundry.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.register(parser.add_subparsers())
    return parser.parse_args(["bench-serve", *argv])


def _record(record: Path, which: str) -> dict:
    return json.loads(Path(f"{record}.{which}.json").read_text())


def test_vllm_peer_command_rows_tau_and_teardown(tiny, fake_venv, tmp_path):
    from specfoundry.bench import serve as bench_serve

    target_dir, head_dir = tiny
    out = tmp_path / "out"
    args = _args("--target", str(target_dir), "--speculator", str(head_dir), "--dtype", "float32", "--threads", "1",
                 "--concurrency", "1,2", "--requests", "2", "--max-tokens", "8", "--depth", "3", "--modes", "off",
                 "--peers", "vllm", "--level-seconds", "60", "--out", str(out))
    assert bench_serve.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["levels"]) == ["off", "vllm-off", "vllm-on"]
    for mode in ("off", "vllm-off", "vllm-on"):
        rows = report["levels"][mode]
        assert [r["concurrency"] for r in rows] == [1, 2]
        assert all(r["requests"] == 2 and r["errors"] == 0 and r["output_tok_s"] > 0 for r in rows), mode
    # τ from the counters around each level only (the warm-up request is excluded): 8 tokens in 1 + 4 steps
    for r in report["levels"]["vllm-on"]:
        assert r["tau"] == pytest.approx(8 / 5) and r["mean_acceptance_length"] == pytest.approx(1 + 3 / 4)
        assert r["spec_decode"] == {"drafts": 8.0, "accepted": 6.0, "drafted": 24.0}
    assert all(r["tau"] is None for r in report["levels"]["vllm-off"])

    off, on = _record(fake_venv, "off"), _record(fake_venv, "on")
    for rec in (off, on):
        argv = rec["argv"]
        assert argv[argv.index("--model") + 1] == str(target_dir)  # the same local target directory our server loads
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--max-num-seqs") + 1] == "2"  # = our --max-batch (largest concurrency)
        assert rec["env"] == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                              "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        # warm-up + 2 levels x 2 requests, all greedy, without our per-request "speculate" field
        assert len(rec["bodies"]) == 5
        assert all(b["temperature"] == 0 and "speculate" not in b and b["model"] == str(target_dir)
                   for b in rec["bodies"])
        assert _gone(rec["pid"], rec["worker_pid"]), "the vLLM peer's process group outlived the bench"
    assert "--speculative-config" not in off["argv"]
    spec = json.loads(on["argv"][on["argv"].index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(out / "vllm_speculator"), "num_speculative_tokens": 3}
    exported = json.loads((out / "vllm_speculator" / "config.json").read_text())
    assert exported["speculators_model_type"] == "eagle3"
    assert exported["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)

    md = (out / "report.md").read_text()
    assert "| 2 | vllm-on |" in md and "| 1 | vllm-off |" in md and "| 1 | off |" in md
    assert "- vllm-on: vLLM 0.0.fake OpenAI server" in md and "num_speculative_tokens 3" in md
    assert report["peers"]["vllm-on"]["started"] and report["peers"]["vllm-off"]["started"]


def test_vllm_peer_unavailable_is_listed_and_the_rest_runs(tiny, tmp_path, monkeypatch):
    from specfoundry.bench import serve as bench_serve

    target_dir, head_dir = tiny
    monkeypatch.setenv("SPECFOUNDRY_VLLM_VENV", str(tmp_path / "no-venv"))
    out = tmp_path / "out"
    args = _args("--target", str(target_dir), "--speculator", str(head_dir), "--dtype", "float32", "--threads", "1",
                 "--concurrency", "1", "--requests", "2", "--max-tokens", "4", "--modes", "off", "--peers", "vllm",
                 "--out", str(out))
    assert bench_serve.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["levels"]) == ["off"] and report["levels"]["off"][0]["requests"] == 2
    for mode in ("vllm-off", "vllm-on"):
        assert report["peers"][mode]["available"] is False
        assert "no-venv does not exist" in report["peers"][mode]["reason"]
    assert "- vllm-on: unavailable: not installed:" in (out / "report.md").read_text()


def test_vllm_on_needs_an_eagle3_head(fake_venv):
    from specfoundry.bench.vllm_server import availability, peer_modes

    assert peer_modes("vllm") == ["vllm-off", "vllm-on"] and peer_modes("vllm-on,vllm") == ["vllm-on", "vllm-off"]
    with pytest.raises(SystemExit, match="unknown peer"):
        peer_modes("sglang")
    st = availability(["vllm-off", "vllm-on"], "float32", "ngram")
    assert st["vllm-off"]["available"] and st["vllm-off"]["version"] == "0.0.fake"
    assert not st["vllm-on"]["available"] and "EAGLE-3" in st["vllm-on"]["reason"]


def test_vllm_peer_is_stopped_when_the_load_fails(tiny, fake_venv, tmp_path, monkeypatch):
    from specfoundry.bench import serve as bench_serve

    target_dir, head_dir = tiny

    async def boom(*a, **k):
        raise RuntimeError("load generator failed")

    monkeypatch.setattr(bench_serve, "_level", boom)
    args = _args("--target", str(target_dir), "--speculator", str(head_dir), "--dtype", "float32", "--threads", "1",
                 "--concurrency", "1", "--modes", "", "--peers", "vllm-off", "--out", str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="load generator failed"):
        bench_serve.main(args)
    rec = _record(fake_venv, "off")
    assert _gone(rec["pid"], rec["worker_pid"]), "the vLLM peer outlived an error in the bench"


def test_vllm_peer_that_fails_to_start_is_reported(tiny, fake_venv, tmp_path, monkeypatch):
    from specfoundry.bench import serve as bench_serve

    target_dir, head_dir = tiny
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    out = tmp_path / "out"
    args = _args("--target", str(target_dir), "--speculator", str(head_dir), "--dtype", "float32", "--threads", "1",
                 "--concurrency", "1", "--modes", "", "--peers", "vllm-off", "--out", str(out))
    assert bench_serve.main(args) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["peers"]["vllm-off"]["started"] is False
    err = report["peers"]["vllm-off"]["error"]
    assert err == "the server exited with code 3: fake vLLM: startup failed on purpose"
    assert "startup failed on purpose" in (out / "vllm-off.log").read_text()
    assert f"- vllm-off: failed to start: {err}" in (out / "report.md").read_text()
    assert _gone(_record(fake_venv, "off")["worker_pid"])
