"""The OpenAI-compatible server: a real ``specfoundry serve`` subprocess on a free loopback port,
driven by the official ``openai`` client (one server for the module), plus in-process checks of
overload (429) and the stop-string matcher.

The target is a tiny random Llama (float32, hidden 32) with the SmolLM2 tokenizer, saved with
``save_pretrained``; the speculator is a slightly perturbed copy of it used as a draft model, so
drafts are partly accepted and every step of the batched speculative path runs.
"""

import concurrent.futures as cf
import json
import os
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specfoundry.runtime.serving.launch import serve_subprocess  # noqa: E402

MODEL = "tiny-serve"
CONTEXT = 1024


def _tokenizer():
    from transformers import AutoTokenizer

    from specfoundry.runtime.models import builtin_model_dir

    try:
        return AutoTokenizer.from_pretrained(builtin_model_dir("smollm2-135m"))
    except Exception as e:  # pragma: no cover - no network and no cached target
        pytest.skip(f"the SmolLM2 tokenizer is not available: {e}")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    root = tmp_path_factory.mktemp("serve")
    target_dir, draft_dir = root / MODEL, root / "draft"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      initializer_range=0.5, eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():  # a draft model that mostly agrees with the target
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std().clamp(min=1e-3))
    model.save_pretrained(draft_dir)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def server(model_dirs):
    target_dir, draft_dir = model_dirs
    # float32 pinned: serve's default (dtype auto: the fastest measured) picked bf16 on some starts on
    # a slow 2-core machine, and bf16 near-ties flip between a request's solo and batched forwards
    # (2 of 6 runs differed at one token), which no exact comparison survives
    args = ["--target", str(target_dir), "--speculator", str(draft_dir), "--max-batch", "8", "--max-queue", "32",
            "--max-context", str(CONTEXT), "--speculation-table", "1-:3", "--threads", "1", "--dtype", "float32"]
    with serve_subprocess(args, timeout=180) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def _metrics(url: str) -> dict:
    """{sample name + sorted labels: value} from /metrics, parsed by prometheus_client."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (json.dumps(sorted(s.labels.items())) if s.labels else "")
            out[key] = s.value
    return out


def _requests_total(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("specfoundry_requests_total"))


def _wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def _alive(client) -> None:
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens >= 1


# -- the real server ---------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["max_batch"] == 8


def test_chat_completion_streamed_equals_non_streamed(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    ch = r.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("length", "stop")
    u = r.usage
    assert 1 <= u.completion_tokens <= 24 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = u.model_extra["speculative_decoding"]
    assert set(spec) == {"tau", "acceptance_by_position", "drafted", "accepted"}
    assert spec["tau"] >= 1.0 and spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ch.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == u.completion_tokens
    assert last.usage.prompt_tokens == u.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # content as text parts is the same conversation
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             msgs[1]]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0)
    assert r2.choices[0].message.content == ch.message.content


def test_completion_text_and_token_ids(client):
    for prompt in ("The capital of France is", [10, 20, 30, 40, 10, 20, 30]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text and r.choices[0].finish_reason in ("length", "stop")
        if isinstance(prompt, list):
            assert r.usage.prompt_tokens == len(prompt)
        parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
        assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
        assert parts[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # sampling with our extensions goes through as well
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=0.8, top_p=0.9, seed=3,
                                  extra_body={"top_k": 20, "speculate": False})
    assert r.usage.completion_tokens >= 1 and r.usage.model_extra["speculative_decoding"]["drafted"] == 0


def test_stop_strings_truncate_and_free_the_slot(server, client):
    full = client.completions.create(model=MODEL, prompt=[7, 8, 9, 7, 8], max_tokens=40, temperature=0)
    text = full.choices[0].text
    assert len(text) > 20
    stop = text[len(text) // 2: len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    r = client.completions.create(model=MODEL, prompt=[7, 8, 9, 7, 8], max_tokens=40, temperature=0,
                                  stop=[stop, "\x00"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 40
    parts = list(client.completions.create(model=MODEL, prompt=[7, 8, 9, 7, 8], max_tokens=40, temperature=0,
                                           stop=stop, stream=True))
    assert "".join(p.choices[0].text for p in parts) == expected
    assert parts[-1].choices[0].finish_reason == "stop"
    # a stop string in the very last text still finishes with "stop"
    tail = text[-2:]
    r = client.completions.create(model=MODEL, prompt=[7, 8, 9, 7, 8], max_tokens=40, temperature=0, stop=tail)
    assert r.choices[0].text == text[: text.find(tail)] and r.choices[0].finish_reason == "stop"
    assert _wait_idle(server)["running"] == 0


def test_sixteen_concurrent_clients_each_get_their_solo_output(server, client):
    jobs = []
    for i in range(16):
        kw = dict(model=MODEL, max_tokens=16 + 3 * (i % 5), temperature=0)
        if i % 4 == 3:
            kw["extra_body"] = {"speculate": False}
        if i % 2:
            jobs.append(("chat", dict(kw, messages=[{"role": "user", "content": f"Tell me fact number {i}."}])))
        else:
            jobs.append(("cmpl", dict(kw, prompt=[(11 * i + j) % 500 + 1 for j in range(3 + i)])))

    def run(job):
        kind, kw = job
        if kind == "chat":
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    solo = [run(j) for j in jobs]
    before = _metrics(server)
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs))
    after = _metrics(server)
    assert together == solo, [(i, a, b) for i, (a, b) in enumerate(zip(together, solo)) if a != b]
    # they really shared steps: mean sequences per step well above 1
    seq_steps = after["specfoundry_sequence_steps_total"] - before["specfoundry_sequence_steps_total"]
    steps = after["specfoundry_step_seconds_count"] - before["specfoundry_step_seconds_count"]
    assert seq_steps / steps > 2


def test_abandoned_streams_and_bad_requests_do_not_disturb_others(server, client):
    prompts = [[(7 * i + j) % 300 + 2 for j in range(4 + i)] for i in range(8)]

    def good(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).choices[0].text

    def abandon(i):
        stream = client.completions.create(model=MODEL, prompt=[9, i + 1, 9], max_tokens=CONTEXT - 8,
                                           temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n == 2 + i:
                break
        stream.close()

    def bad(i):
        body = [{"model": MODEL, "prompt": []}, b"{", {"model": MODEL, "prompt": "x", "top_k": -1},
                {"model": MODEL, "prompt": [1] * (CONTEXT + 1)}][i]
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        return httpx.post(server + "/v1/completions", timeout=30, **kw).status_code

    solo = [good(p) for p in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        goods = [pool.submit(good, p) for p in prompts]
        others = [pool.submit(abandon, i) for i in range(4)] + [pool.submit(bad, i) for i in range(4)]
        assert [f.result() for f in goods] == solo
        assert [f.result() for f in others][4:] == [400] * 4
    h = _wait_idle(server)
    assert h["running"] == 0 and h["waiting"] == 0


def test_cancelled_stream_frees_its_slot(server, client):
    before = _metrics(server)
    stream = client.completions.create(model=MODEL, prompt=[3, 1, 4, 1, 5], max_tokens=CONTEXT - 8, temperature=0,
                                       stream=True)
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()  # the client goes away mid-stream
    h = _wait_idle(server)
    assert h["running"] == 0 and h["waiting"] == 0
    key = 'specfoundry_requests_total[["finish_reason", "cancelled"]]'
    deadline = time.monotonic() + 10
    while _metrics(server).get(key, 0) < before.get(key, 0) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metrics(server).get(key, 0) == before.get(key, 0) + 1
    _alive(client)


BAD = [
    ("/v1/completions", b'{"model": "tiny-serve", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("/v1/completions", b"\xff\xfe{}", 400, None),
    ("/v1/completions", b'{"model": "tiny-serve", "prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2.5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 10, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * (CONTEXT + 5), "max_tokens": 1}, 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": 0}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2 ** 64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [str(i) for i in range(40)]}, 400, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x", "extra": 1}]}, 400, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_answers_4xx_with_an_openai_error(server, client, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    _alive(client)


def test_the_openai_client_raises_its_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"speculative": True})
    _alive(client)


def test_extreme_valid_sampling_values_do_not_break_the_engine(server, client):
    """Values inside the ranges that float32 sampling cannot take as such (logits / 1e-300 is inf,
    top_p 1e-300 rounds to 0): the server maps them to what they mean (greedy, the top token)."""
    greedy = client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=8, temperature=0)
    for kw in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
               {"temperature": 2.0, "extra_body": {"top_k": 1}},
               {"temperature": 1.0, "seed": -(2 ** 63)}):
        r = client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=8, **kw)
        assert r.choices[0].finish_reason in ("length", "stop")
        if "seed" not in kw:
            assert r.choices[0].text == greedy.choices[0].text
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_metrics_add_up_to_what_the_clients_received(server, client):
    _wait_idle(server)
    before = _metrics(server)
    received, prompts = 0, 0
    for i in range(4):
        kw = dict(model=MODEL, prompt=[20 + i, 21, 22, 20 + i, 21], max_tokens=12 + i, temperature=0)
        if i == 3:
            kw["extra_body"] = {"speculate": False}
        if i % 2:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            usage = chunks[-1].usage
        else:
            usage = client.completions.create(**kw).usage
        received += usage.completion_tokens
        prompts += usage.prompt_tokens
    deadline = time.monotonic() + 10
    after = _metrics(server)
    while _requests_total(after) < _requests_total(before) + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = _metrics(server)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert _requests_total(after) - _requests_total(before) == 4
    assert delta("specfoundry_generation_tokens_total") == received
    assert delta("specfoundry_prompt_tokens_total") == prompts
    assert delta("specfoundry_time_to_first_token_seconds_count") == 4
    assert delta("specfoundry_e2e_request_latency_seconds_count") == 4
    # speculation ran and its counters are consistent
    drafts = after["specfoundry_spec_decode_num_drafts_total"]
    tokens = after["specfoundry_spec_decode_num_draft_tokens_total"]
    accepted = after["specfoundry_spec_decode_num_accepted_tokens_total"]
    per_pos = [v for k, v in after.items() if k.startswith("specfoundry_spec_decode_num_accepted_tokens_per_pos_total")]
    assert drafts > 0 and tokens >= drafts and 0 < accepted <= tokens
    assert sum(per_pos) == accepted
    steps = after["specfoundry_sequence_steps_total"]
    assert after["specfoundry_tau"] == pytest.approx(after["specfoundry_generation_tokens_total"] / steps)
    assert 1.0 <= after["specfoundry_tau"] <= 4.0
    for name in ("specfoundry_batch_size", "specfoundry_queue_depth", "specfoundry_running",
                 "specfoundry_speculating_requests", "specfoundry_inter_token_latency_seconds_count",
                 "process_resident_memory_bytes"):
        assert name in after
    assert after["specfoundry_running"] == 0 and after["specfoundry_queue_depth"] == 0
    # the HTTP side: 4 completions, each a 200 on /v1/completions; the bad inputs were counted as 4xx
    assert sum(v for k, v in after.items() if k.startswith("specfoundry_completions_total")) - \
        sum(v for k, v in before.items() if k.startswith("specfoundry_completions_total")) == 4
    ok = 'specfoundry_http_responses_total[["path", "/v1/completions"], ["status", "200"]]'
    assert after[ok] - before.get(ok, 0) == 4
    assert any(k.startswith("specfoundry_http_responses_total") and '"400"' in k for k in after)
    assert after.get('specfoundry_completions_total[["finish_reason", "stop"]]', 0) >= 1  # stop strings


# -- in process ------------------------------------------------------------------------------------

def test_full_queue_answers_429_and_recovers():
    from starlette.testclient import TestClient

    from tiny_models import tiny_llama
    from specfoundry.runtime.serving import Request, ServingEngine
    from specfoundry.runtime.serving.metrics import PrometheusMetrics
    from specfoundry.runtime.serving.server import create_app

    class GatedMetrics(PrometheusMetrics):
        """Holds the engine thread inside its first step until released: the one slot stays busy."""

        def __init__(self):
            super().__init__()
            self.entered, self.gate = threading.Event(), threading.Event()

        def step(self, *a):
            self.entered.set()
            self.gate.wait(30)
            super().step(*a)

    metrics = GatedMetrics()
    engine = ServingEngine(tiny_llama(0, dtype=torch.float32), None, max_batch=1, max_queue=0, metrics=metrics)
    try:
        busy = engine.submit(Request([1, 2, 3], max_new_tokens=50))
        assert metrics.entered.wait(30)
        with TestClient(create_app(engine, "tiny", metrics)) as http:
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
            assert r.headers["retry-after"] == "1"
            # a model without a tokenizer: chat and text prompts are refused, token ids work
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            busy.cancel()
            metrics.gate.set()
            for _ in busy:
                pass
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
            assert "specfoundry_requests_total" in http.get("/metrics").text
    finally:
        metrics.gate.set()
        engine.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's own
def test_an_engine_failure_is_a_500_then_503_never_a_hang():
    from starlette.testclient import TestClient

    from tiny_models import tiny_llama
    from specfoundry.runtime.serving import ServingEngine
    from specfoundry.runtime.serving.metrics import PrometheusMetrics
    from specfoundry.runtime.serving.server import create_app

    class Broken(PrometheusMetrics):
        def step(self, *a):
            raise RuntimeError("boom")

    engine = ServingEngine(tiny_llama(0, dtype=torch.float32), None, max_batch=2, metrics=Broken())
    try:
        with TestClient(create_app(engine, "tiny", None)) as http:
            body = {"model": "tiny", "prompt": [1, 2], "max_tokens": 4}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
            assert http.get("/health").status_code == 503
            assert http.get("/metrics").status_code == 404  # no metrics object given
    finally:
        engine.close()


def test_stop_matcher_holds_back_what_may_become_a_stop_string():
    from specfoundry.runtime.serving.server import _StopMatcher

    m = _StopMatcher(["END", "xyz"])
    assert m.feed("abc E") == "abc "  # "E" may start "END"
    assert m.feed("Nd") == "ENd"
    assert m.feed(" fooEN") == " foo"
    assert m.feed("D and more") == "" and m.stopped
    assert m.text == "abc ENd foo"
    m = _StopMatcher([])
    assert m.feed("a") == "a" and m.feed("b") == "b" and not m.stopped


def test_serve_command_defaults_to_loopback():
    from specfoundry.runtime.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_batch == 8 and args.max_queue == 64
    assert args.target == "smollm2-135m"


def test_bench_serve_sweeps_modes_and_writes_its_report(model_dirs, tmp_path):
    """`specfoundry bench-serve` end to end on the tiny model: three server processes (off has its own,
    so plain requests never move the load-aware policy's estimates), three modes per concurrency level
    in two rounds each, every request answered, the table, JSON and plot written."""
    import argparse
    import json

    from specfoundry.bench import serve as bench_serve

    target_dir, draft_dir = model_dirs
    parser = argparse.ArgumentParser()
    bench_serve.register(parser.add_subparsers())
    args = parser.parse_args(["bench-serve", "--target", str(target_dir), "--speculator", str(draft_dir),
                              "--dtype", "float32", "--threads", "1", "--concurrency", "1,2", "--requests", "2",
                              "--max-tokens", "8", "--level-seconds", "60", "--rounds", "2",
                              "--out", str(tmp_path / "out")])
    assert bench_serve.main(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    for mode in ("off", "on", "load-aware"):
        rows = report["levels"][mode]
        assert [r["concurrency"] for r in rows] == [1, 2]
        assert all(r["rounds"] == 2 and r["requests"] == 4 and r["errors"] == 0 for r in rows)
        assert all(0 < r["output_tok_s"] and 0 < r["steady_tok_s"] for r in rows)
    assert len(set(report["servers"].values())) == 3  # one process per mode
    assert all(r["tau"] == pytest.approx(1.0) for r in report["levels"]["off"])  # speculate: false really is off
    assert any(r["tau"] > 1.0 for r in report["levels"]["on"])  # the always-on server drafted and accepted
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| 2 | load-aware |" in md and "CPU stolen" in md
    if os.path.exists("/proc/stat"):  # each level says how much CPU the hypervisor took meanwhile
        assert all(0.0 <= r["steal"] <= 1.0 for rows in report["levels"].values() for r in rows)


def test_bench_serve_pools_rounds_and_counts_the_steady_part():
    from specfoundry.bench.serve import summarise, tokens_before

    r = {"tokens": 11, "t_first": 10.0, "t_end": 20.0, "latency": 12.0, "ttft": 2.0, "tpot": 1.0, "forwards": 5.5}
    assert tokens_before(r, 9.0) == 0 and tokens_before(r, 25.0) == 11
    assert tokens_before(r, 15.0) == pytest.approx(6.0)  # the first token, then half of the other ten
    a = {"results": [r], "errors": [], "seconds": 20.0, "steady_seconds": 15.0, "steady_tokens": 6.0}
    b = {"results": [r, r], "errors": ["x"], "seconds": 30.0, "steady_seconds": 25.0, "steady_tokens": 34.0}
    row = summarise(4, [a, b])
    assert row["rounds"] == 2 and row["requests"] == 3 and row["errors"] == 1
    assert row["output_tok_s"] == pytest.approx(33 / 50) and row["steady_tok_s"] == pytest.approx(40 / 40)
    assert row["tau"] == pytest.approx(2.0)
    assert row["steal"] is None  # runs that could not read /proc/stat
    a["steal"], b["steal"] = 0.5, 0.0  # half the CPU stolen in the first round's 20 s, none in the 30 s after
    assert summarise(4, [a, b])["steal"] == pytest.approx(10 / 50)


def test_cpu_steal_is_read_from_proc_stat():
    from specfoundry.bench.measure import cpu_ticks, steal_fraction

    # user nice system idle iowait irq softirq steal guest guest_nice
    before = cpu_ticks("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\n")
    after = cpu_ticks("cpu  150 0 60 830 10 0 0 100 0 0\n")
    assert before == (40, 1000) and after == (100, 1150)
    assert steal_fraction(before, after) == pytest.approx(60 / 150)
    assert steal_fraction(None, after) is None and cpu_ticks("garbage") is None


def test_soak_rss_trend_separates_warm_up_from_growth():
    from specfoundry.bench.serve import rss_trend

    # warm-up then flat: all growth in the first half
    flat = rss_trend([(0, 1000.0), (15, 1200.0), (30, 1250.0), (45, 1250.0), (60, 1251.0)])
    assert flat["rss_first_half_mb"] == 250.0 and flat["rss_second_half_mb"] == 1.0
    # steady growth: 10 MB every 15 s -> 40 MB/min over the second half
    leak = rss_trend([(t, 1000.0 + 10 * t / 15) for t in range(0, 121, 15)])
    assert leak["rss_second_half_mb_per_min"] == pytest.approx(40.0)
    # a flat server whose samples swing with the phase just served: no growth, whatever the last sample
    swing = rss_trend([(t, 1000.0 + (80 if (t // 15) % 2 else -80)) for t in range(0, 601, 15)])
    assert abs(swing["rss_second_half_mb_per_min"]) < 3
    # a server without the process collector reports nothing rather than a made-up trend
    assert rss_trend([(0, None), (15, None)])["rss_second_half_mb"] is None
    # samples may carry the phase's concurrency as a third field
    assert rss_trend([(0, 1000.0, 0), (15, 1100.0, 4), (30, 1100.0, 8)])["rss_first_half_mb"] == 100.0


def test_serve_bounds_the_shape_keyed_kernel_caches_unless_the_user_set_them():
    from specfoundry.runtime.serving.cli import NATIVE_CACHE_CAPACITY, NATIVE_CACHES, bound_native_caches

    env = {}
    assert bound_native_caches(env=env) == {name: str(NATIVE_CACHE_CAPACITY) for name in NATIVE_CACHES}
    # bounded (~300 kB per entry), yet holding every shape of a target's five products (QKV, O,
    # gate/up, down, LM head) up to 1,024 rows, bucketed: a smaller cap churned (+20% on products)
    from specfoundry.runtime.engine import row_bucket

    assert 5 * len({row_bucket(m) for m in range(1, 1025)}) <= NATIVE_CACHE_CAPACITY <= 512
    env = {}
    assert bound_native_caches(256, env) == {name: "256" for name in NATIVE_CACHES}
    env = {"LRU_CACHE_CAPACITY": "2048"}  # the user's choice wins
    assert bound_native_caches(256, env)["LRU_CACHE_CAPACITY"] == "2048"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"


def test_bench_serve_levels_take_unused_prompts(monkeypatch):
    """Each level of the sweep continues from the next unused prompt (wrapping around), so a peer
    with a prefix cache is never served a prompt it has seen in an earlier level."""
    import asyncio

    from specfoundry.bench import serve as bench_serve

    seen = []

    async def fake_one(client, url, messages, max_tokens, speculate, *a, **k):
        seen.append(messages)
        return {"tokens": 1, "latency": 0.0, "ttft": 0.0, "tpot": None, "tau": None, "forwards": None,
                "t_first": 0.0, "t_end": 0.0}

    monkeypatch.setattr(bench_serve, "_one", fake_one)
    prompts = [[{"role": "user", "content": str(i)}] for i in range(6)]
    asyncio.run(bench_serve._level("http://127.0.0.1:9", prompts, 2, 4, 30, 8, None, start=4))
    assert [m[0]["content"] for m in seen] == ["4", "5", "0", "1"]
