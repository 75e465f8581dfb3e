"""Training data pipeline: prompt sources, Magpie synthesis, cached self-distillation, loss
masks, and online/offline hidden-state batches."""

import json
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")

from specfoundry.train import data as tdata  # noqa: E402
from specfoundry.train import generation as tgen  # noqa: E402
from specfoundry.train.data import ChunkReport, build_dataset, make_example, self_distill  # noqa: E402
from specfoundry.train.features import HiddenStateSource, batch_order  # noqa: E402
from specfoundry.train.prompts import extract_prompt, load_prompts, magpie_prompts, read_prompt_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# one intra-op thread: on the shared 2-core machine a 2-thread SmolLM2 generation ran ~13x slower
pytestmark = pytest.mark.usefixtures("single_thread")


def _shared_data() -> Path | None:
    for base in (ROOT.parent / "shared", Path("/work/shared")):
        if (base / "data").is_dir():
            return base / "data"
    return None


def _write_jsonl(path: Path, records) -> Path:
    # ensure_ascii=False keeps U+2028 raw in the file: the reader must split on "\n" only
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------------------
# prompt sources
# ----------------------------------------------------------------------------------------------


def test_prompt_extraction_from_each_file_format(tmp_path):
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": " How do magnets work? "},
                                      {"from": "gpt", "value": "They..."}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start, so skip me"},
                                      {"from": "human", "value": "late question"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "   "}]},
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"role": "user", "content": "role/content turns work too"}]},
    ]))
    assert read_prompt_file(sharegpt) == ["How do magnets work?", "role/content turns work too"]

    turns = _write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["First\u2028turn with a line separator", "Second"]},
        {"question_id": 82, "category": "math", "turns": ["What is 2+2?"]},
    ])
    got = read_prompt_file(turns)
    assert got == ["First\u2028turn with a line separator", "What is 2+2?"]  # U+2028 did not split a record

    _write_jsonl(tmp_path / "p.jsonl", [{"uid": "x", "prompt": "Write a haiku."}, {"prompt": ""}])
    assert read_prompt_file(tmp_path / "p.jsonl") == ["Write a haiku."]

    _write_jsonl(tmp_path / "inst.jsonl", [
        {"instruction": "Translate to French.", "input": "Good morning"},
        {"instruction": "Name three colors.", "input": ""},
        {"id": "seed_task_0", "instruction": "Fix the grammar.", "instances": [{"input": "he go home", "output": "."}]},
    ])
    assert read_prompt_file(tmp_path / "inst.jsonl") == [
        "Translate to French.\n\nGood morning", "Name three colors.", "Fix the grammar.\n\nhe go home"]

    _write_jsonl(tmp_path / "q.jsonl", [{"question": "Natalia sold clips ...?", "answer": "72"}])
    assert read_prompt_file(tmp_path / "q.jsonl") == ["Natalia sold clips ...?"]

    _write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]},
        {"messages": [{"role": "assistant", "content": "no user first"}]},
    ])
    assert read_prompt_file(tmp_path / "m.jsonl") == ["Why is the sky blue?"]

    # a record of no known format, and the limit/shuffle options of a file source
    assert extract_prompt({"text": "unknown format"}) is None
    many = _write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"prompt {i}"} for i in range(20)])
    assert read_prompt_file(many, limit=3) == ["prompt 0", "prompt 1", "prompt 2"]
    sampled = read_prompt_file(many, limit=3, shuffle=True, seed=1)
    assert len(set(sampled)) == 3 and sampled != ["prompt 0", "prompt 1", "prompt 2"]
    assert sampled == read_prompt_file(many, limit=3, shuffle=True, seed=1)


def test_load_prompts_dedups_across_sources_and_reads_hub_builders(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Tell me a joke."}, {"prompt": "What is DNA?"}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"question": "what is  DNA"}, {"question": "Name a planet."}])
    got = load_prompts([
        {"source": "file", "path": str(a)},
        # the datasets-hub path, through a local builder (no network in tests)
        {"source": "hub", "name": "json", "data_files": str(b), "split": "train",
         "cache_dir": str(tmp_path / "hf")},
    ])
    assert got == ["Tell me a joke.", "What is DNA?", "Name a planet."]
    with pytest.raises(ValueError, match="unknown prompt source"):
        load_prompts([{"source": "nope"}])


def test_read_real_prompt_files_shared_data():
    data = _shared_data()
    if data is None:
        pytest.skip("../shared/data (public prompt files) is not present on this machine")
    train = data / "train"
    assert len(read_prompt_file(train / "gsm8k_train.jsonl")) == 7473
    assert len(read_prompt_file(train / "arena_hard_v2.jsonl")) == 750
    seeds = read_prompt_file(train / "self_instruct_seed_tasks.jsonl")
    assert len(seeds) == 175 and all(s.strip() for s in seeds)
    for f in sorted((train / "sharegpt_prompts").glob("*.json")):
        records = json.loads(f.read_text())
        got = read_prompt_file(f)
        # first human turns only; records that start otherwise (or empty) are skipped
        expect = sum(1 for r in records if r.get("conversations") and r["conversations"][0].get("from") == "human"
                     and r["conversations"][0].get("value", "").strip())
        assert len(got) == expect > 0.5 * len(records)
        assert all(p.strip() == p and p for p in got)
    spec = read_prompt_file(data / "eval" / "spec_bench" / "question.jsonl")
    assert len(spec) == 480


# ----------------------------------------------------------------------------------------------
# Magpie
# ----------------------------------------------------------------------------------------------


def _count_generate_calls(monkeypatch, fail_on_call: int | None = None) -> list:
    calls = []
    real = tgen.generate_batched

    def wrapped(*args, **kwargs):
        calls.append(len(args[1]))
        if fail_on_call is not None and len(calls) == fail_on_call:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(tgen, "generate_batched", wrapped)
    return calls


def test_magpie_on_tiny_target_gives_distinct_prompts_and_caches(tiny_target, tmp_path, monkeypatch):
    calls = _count_generate_calls(monkeypatch)
    cfg = dict(max_prompt_tokens=12, round_size=16, batch_size=8, require_finished=False, seed=3)
    got = magpie_prompts(tiny_target, 10, cache_dir=tmp_path, **cfg)
    assert len(got) == 10 and len(set(got)) == 10 and all(p.strip() for p in got)
    assert calls, "nothing was generated"
    n_calls = len(calls)
    # asking again (or for fewer) reuses the cached rounds
    assert magpie_prompts(tiny_target, 10, cache_dir=tmp_path, **cfg) == got
    assert magpie_prompts(tiny_target, 6, cache_dir=tmp_path, **cfg) == got[:6]
    assert len(calls) == n_calls
    # another seed writes other prompts
    other = magpie_prompts(tiny_target, 10, cache_dir=tmp_path, **{**cfg, "seed": 4})
    assert other != got


def test_a_magpie_round_declined_before_the_deadline_is_reported_as_the_guard(tiny_target, tmp_path, monkeypatch):
    """A round is not started when it would end past the prompts' deadline, which happens while the
    clock is still short of it: the dataset's stats must still say a guard stopped the data."""
    import types

    from specfoundry.train import datacache

    ticks = iter(range(0, 10 ** 7, 1000))  # every timed round appears to take 1000 s
    monkeypatch.setattr(datacache, "time", types.SimpleNamespace(time=time.time, perf_counter=lambda: next(ticks)))
    src = [{"source": "magpie", "count": 50, "max_prompt_tokens": 8, "round_size": 4, "require_finished": False}]
    stats = {}
    build_dataset(src, tiny_target, responses_cfg={"max_new_tokens": 4, "batch_size": 4}, max_seq_len=64,
                  cache_dir=tmp_path / "c", max_minutes=10.0, stats=stats)  # prompts' share: 4 min > one round
    assert stats["prompts"] < 50 and stats["chunks_skipped"] == 0
    assert stats["stopped_by_guard"] is True


def test_magpie_smollm2_writes_real_questions(smollm2, tmp_path):
    got = magpie_prompts(smollm2, 6, cache_dir=None, max_prompt_tokens=48, round_size=12, max_rounds=2, seed=0)
    assert len(got) >= 4 and len(set(got)) == len(got)
    common = {"the", "a", "to", "of", "and", "in", "is", "how", "what", "i", "you", "for", "can", "write", "me"}
    english = [p for p in got if common & {w.strip(".,?!:").lower() for w in p.split()}]
    assert len(english) >= 0.75 * len(got), got
    assert all("<|" not in p and "im_start" not in p for p in got), got


# ----------------------------------------------------------------------------------------------
# self-distillation
# ----------------------------------------------------------------------------------------------


def test_self_distill_resumes_after_a_kill_without_recomputing(tiny_target, tmp_path, monkeypatch):
    prompts = [" ".join(str(5 + (i * 7 + j) % 50) for j in range(3 + i % 4)) for i in range(10)]
    cfg = {"max_new_tokens": 6, "temperature": 1.0, "top_p": 0.9, "batch_size": 3, "chunk_size": 4}
    reference = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "ref", seed=7)

    calls = _count_generate_calls(monkeypatch, fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7)
    assert calls == [4, 4]  # chunk 1 finished and was saved; chunk 2 was killed
    chunk_dirs = [p for p in (tmp_path / "run").rglob("chunk-*") if p.is_dir()]
    assert len(chunk_dirs) == 1

    # out of time: nothing new starts, the finished chunk is still returned
    calls = _count_generate_calls(monkeypatch)
    report = ChunkReport()
    partial = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7, report=report,
                           deadline=time.time() - 1)
    assert calls == [] and (report.computed, report.reused, report.skipped) == (0, 1, 2)
    assert partial.to_dict() == reference.select(range(4)).to_dict()

    report = ChunkReport()
    resumed = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7, report=report)
    assert (report.computed, report.reused) == (2, 1)
    assert calls == [4, 2]  # only the two missing chunks were generated
    assert resumed.to_dict() == reference.to_dict()
    assert resumed["prompt"] == prompts
    assert all(0 < len(r) <= 6 for r in resumed["response_ids"])

    # a different generation config is a different cache entry, not a silent reuse
    report = ChunkReport()
    self_distill(prompts, tiny_target, responses_cfg={**cfg, "max_new_tokens": 5}, cache_dir=tmp_path / "run",
                 seed=7, report=report)
    assert report.reused == 0



def test_self_distill_reuses_every_prompt_answered_before_when_the_list_changes(tiny_target, tmp_path, monkeypatch):
    # a recipe that gains prompts (and so moves others between the held-out and training splits)
    # used to recompute every chunk after the first change; only new prompts are generated now
    prompts = [" ".join(str(5 + (i * 7 + j) % 50) for j in range(3 + i % 4)) for i in range(10)]
    cfg = {"max_new_tokens": 6, "temperature": 0.0, "batch_size": 3, "chunk_size": 4}
    first = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path, seed=7)
    answers = dict(zip(first["prompt"], first["response_ids"]))

    calls = _count_generate_calls(monkeypatch)
    grown = ["9 9 9", "8 8"] + prompts[:3] + prompts[4:] + ["7 7 7 7"]  # new at both ends, one dropped
    report = ChunkReport()
    again = self_distill(grown, tiny_target, responses_cfg=cfg, cache_dir=tmp_path, seed=7, report=report)
    assert calls == [3]  # the three new prompts, in one chunk
    assert (report.computed, report.items_reused) == (1, 9) and report.reused == 3
    assert again["prompt"] == grown
    assert all(again["response_ids"][i] == answers[p] for i, p in enumerate(grown) if p in answers)

    # out of time for the new ones: the reused prompts come back alone, in the list's order
    calls.clear()
    report = ChunkReport()
    partial = self_distill(["1 2 3"] + prompts[::-1], tiny_target, responses_cfg=cfg, cache_dir=tmp_path, seed=7,
                           report=report, deadline=time.time() - 1)
    assert calls == [] and report.skipped == 1 and partial["prompt"] == prompts[::-1]


def test_self_distill_cuts_the_chunk_that_would_end_past_the_deadline_to_what_fits(tiny_target, tmp_path, monkeypatch):
    # skipping that chunk whole left up to a chunk's time of the budget unused; keyed by prompt, the part
    # of it expected to fit is answered, and a rerun with more time answers only the rest
    prompts = [" ".join(str(5 + (i * 7 + j) % 50) for j in range(3 + i % 4)) for i in range(10)]
    cfg = {"max_new_tokens": 6, "temperature": 0.0, "batch_size": 3, "chunk_size": 8}
    reference = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "ref", seed=7)

    calls = _count_generate_calls(monkeypatch)
    # the last chunk: 8 prompts in 800 s; 550 s left -> CUT_SAFETY * 550 s / 100 s a prompt = 4 of the next 8
    report = ChunkReport(last_seconds=800.0, last_items=8)
    part = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7, report=report,
                        deadline=time.time() + 550)
    # (the time the call takes before it sizes the cut counts against the 550 s: 4 until 50 s of it)
    assert calls == [4] and report.cut == (4, 8) and (report.computed, report.skipped) == (1, 1)  # no chunk after it
    assert part["prompt"] == prompts[:4] and part["response_ids"] == reference["response_ids"][:4]

    # less time than an eighth of the chunk takes: skipped whole, the cached prompts come back alone
    report = ChunkReport(last_seconds=80.0, last_items=8)
    again = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7, report=report,
                         deadline=time.time() + 5.6)
    assert calls == [4] and report.cut is None and report.skipped == 1 and again["prompt"] == prompts[:4]

    report = ChunkReport()
    full = self_distill(prompts, tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "run", seed=7, report=report)
    assert calls == [4, 6] and report.items_reused == 4 and full.to_dict() == reference.to_dict()

    # a (last) chunk small enough to fit whole is computed whole, and is no cut (1 s a prompt, 500 s left: the
    # last chunk's 800 s would not fit, its 3 prompts do)
    report = ChunkReport(last_seconds=800.0, last_items=800)
    small = self_distill(prompts[:3], tiny_target, responses_cfg=cfg, cache_dir=tmp_path / "small", seed=7,
                         report=report, deadline=time.time() + 500)
    assert calls == [4, 6, 3] and report.cut is None and report.skipped == 0 and len(small) == 3


def test_eval_split_is_deterministic_disjoint_and_stable():
    prompts = [f"prompt {i}" for i in range(40)]
    train, held = tdata.split_eval(prompts, 8, seed=3)
    assert len(held) == 8 and not set(train) & set(held) and sorted(train + held) == sorted(prompts)
    assert train == [p for p in prompts if p in set(train)]  # input order kept
    assert tdata.split_eval(prompts, 8, seed=3) == (train, held)
    assert tdata.split_eval(prompts, 8, seed=4)[1] != held
    _, held_more = tdata.split_eval(prompts + ["prompt 40"], 8, seed=3)
    assert len(set(held_more) ^ set(held)) <= 2  # one new prompt displaces at most one held-out prompt
    assert len(tdata.split_eval(prompts, 0.25, seed=0)[1]) == 10
    assert tdata.split_eval(prompts, ["prompt 3"], seed=0) == ([p for p in prompts if p != "prompt 3"], ["prompt 3"])


def test_make_example_truncates_and_masks():
    ex = make_example([1, 2, 3], [4, 5, 6, 7], max_seq_len=6)
    assert ex == {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [False] * 3 + [True] * 3, "prompt_len": 3}
    assert make_example([1, 2, 3], [4], max_seq_len=3) is None  # no assistant token survives
    ex = make_example([1, 2, 3], [4, 5], max_seq_len=8, loss_on_prompt=True)
    assert ex["loss_mask"] == [False, True, True, True, True]


def test_loss_mask_covers_exactly_the_assistant_tokens_smollm2(smollm2, tmp_path):
    f = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Name a primary color."}, {"prompt": "Say hello in French."},
                                           {"prompt": "What is 3 + 4?"}])
    common = dict(responses_cfg={"max_new_tokens": 10, "batch_size": 2, "chunk_size": 2}, eval_prompts=1,
                  cache_dir=tmp_path / "cache", seed=0)
    ds, held = build_dataset([{"source": "file", "path": str(f)}], smollm2, max_seq_len=64, **common)
    tok = smollm2.tokenizer
    assert len(ds) == 2 and len(held) == 1 and held[0] not in ds["prompt"]
    for row in ds:
        ids, mask = row["input_ids"], row["loss_mask"]
        first = mask.index(True)
        assert first == row["prompt_len"] and all(mask[first:]) and not any(mask[:first])
        prompt_text = tok.decode(ids[:first])
        assert prompt_text.endswith("<|im_start|>user\n" + row["prompt"] + "<|im_end|>\n<|im_start|>assistant\n")
        answer = tok.decode(ids[first:], skip_special_tokens=True)
        assert answer == row["response"] and answer.strip()
        assert "<|im_start|>" not in tok.decode(ids[first:])  # no template token leaked into the labels

    # loss_on_prompt reuses the cached responses and marks every position but the first
    ds2, _ = build_dataset([{"source": "file", "path": str(f)}], smollm2, max_seq_len=64, loss_on_prompt=True,
                           **common)
    assert ds2["input_ids"] == ds["input_ids"]
    assert all(m == [False] + [True] * (len(m) - 1) for m in ds2["loss_mask"])


def test_build_dataset_end_to_end_tiny_with_cache(tiny_target, tmp_path, monkeypatch):
    f = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{10 + i} {20 + i} {30 + i}"} for i in range(6)])
    sources = [{"source": "magpie", "count": 6, "max_prompt_tokens": 8, "round_size": 8, "require_finished": False},
               {"source": "file", "path": str(f)}]
    kw = dict(responses_cfg={"max_new_tokens": 8, "batch_size": 4, "chunk_size": 4}, max_seq_len=96, eval_prompts=3,
              cache_dir=tmp_path / "cache", seed=1)
    ds, held = build_dataset(sources, tiny_target, **kw)
    assert len(held) == 3 and len(ds) == 12 - 3
    assert not set(held) & set(ds["prompt"])
    assert ds["id"] == list(range(len(ds)))
    for row in ds:
        assert len(row["input_ids"]) == len(row["loss_mask"]) <= 96
        assert any(row["loss_mask"]) and not any(row["loss_mask"][:row["prompt_len"]])
    calls = _count_generate_calls(monkeypatch)
    ds_again, held_again = build_dataset(sources, tiny_target, **kw)
    assert calls == [] and held_again == held and ds_again.to_dict() == ds.to_dict()


def test_build_dataset_gives_prompts_only_their_share_of_the_budget(tiny_target, tmp_path, monkeypatch):
    seen = {}
    real = tdata.load_prompts

    def spy(sources, **kw):
        seen["deadline"] = kw["deadline"]
        return real(sources, **kw)

    monkeypatch.setattr(tdata, "load_prompts", spy)
    f = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{10 + i} {20 + i}"} for i in range(4)])
    t0 = time.time()
    build_dataset([{"source": "file", "path": str(f)}], tiny_target, responses_cfg={"max_new_tokens": 4, "batch_size": 4},
                  max_seq_len=64, cache_dir=tmp_path / "c", max_minutes=10.0)
    # 10 minutes of budget: Magpie rounds may start for 4 of them, responses get the rest
    assert t0 + 60 * 10 * tdata.PROMPT_SHARE - 1 <= seen["deadline"] <= time.time() + 60 * 10 * tdata.PROMPT_SHARE


def test_build_dataset_with_no_examples_is_a_clear_error(tiny_target, tmp_path):
    f = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"{10 + i} {20 + i}"} for i in range(4)])
    # a spent budget: the prompts load (a file costs no generation), no response chunk starts
    with pytest.raises(ValueError, match=r"no training examples: 4 prompts, 4 to self-distill, 0 response chunks "
                                         r"done within data.max_minutes=0.0 \(1 chunks left; .*rerun"):
        build_dataset([{"source": "file", "path": str(f)}], tiny_target, responses_cfg={"max_new_tokens": 4},
                      max_seq_len=64, cache_dir=tmp_path / "c", max_minutes=0.0)
    assert not list((tmp_path / "c").glob("datasets/*/dataset_info.json")), "an empty dataset was cached"


# ----------------------------------------------------------------------------------------------
# hidden states
# ----------------------------------------------------------------------------------------------


def _token_dataset(n=7, seed=0, vocab=64):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": []}
    for i in range(n):
        L = int(torch.randint(5, 19, (1,), generator=g))
        ex = make_example(torch.randint(0, vocab, (L,), generator=g).tolist(), [7, 8, 9], max_seq_len=20)
        rows["id"].append(100 + i)
        rows["input_ids"].append(ex["input_ids"])
        rows["loss_mask"].append(ex["loss_mask"])
    return Dataset.from_dict(rows)


def _same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_online_and_offline_batches_are_identical(tiny_target, tmp_path, dtype):
    ds = _token_dataset()
    layers = (1, 2, tiny_target.num_layers)
    online = HiddenStateSource("online", tiny_target, layers, dtype=dtype)
    offline = HiddenStateSource("offline", tiny_target, layers, cache_dir=tmp_path / "hs", dtype=dtype, shard_tokens=40)
    offline.prepare(ds)
    manifest = json.loads((tmp_path / "hs" / "manifest.json").read_text())
    assert manifest["complete"] and len(manifest["shards"]) > 1
    assert manifest["header"]["feature_layers"] == list(layers)
    assert manifest["header"]["target"]["fingerprint"] == tiny_target.fingerprint()
    assert sorted(i for s in manifest["shards"].values() for i in s["example_ids"]) == ds["id"]

    a = list(online.batches(ds, 3, seed=5, epoch=2))
    b = list(offline.batches(ds, 3, seed=5, epoch=2))
    _same_batches(a, b)
    want_dtype = dtype or tiny_target.dtype
    assert a[0]["features"].dtype == want_dtype and a[0]["features"].shape[2:] == (3, tiny_target.hidden_size)

    # one padded forward per batch (the GPU-friendly online option) agrees up to rounding
    fast = list(HiddenStateSource("online", tiny_target, layers, dtype=dtype, online_batched=True).batches(
        ds, 3, seed=5, epoch=2))
    for x, y in zip(fast, a):
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.allclose(x[k].double(), y[k].double(), atol=1e-5), k

    # batched offline capture (length-sorted padded forwards): the same values up to rounding,
    # and a manifest header of its own so the two captures never mix in one cache
    grouped = HiddenStateSource("offline", tiny_target, layers, cache_dir=tmp_path / "hs4", dtype=dtype,
                                shard_tokens=40, capture_batch_size=4)
    grouped.prepare(ds, progress=False)
    for x, y in zip(grouped.batches(ds, 3, seed=5, epoch=2), a):
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.allclose(x[k].double(), y[k].double(), atol=1e-5), k
    assert json.loads((tmp_path / "hs4" / "manifest.json").read_text())["header"]["capture_batch_size"] == 4
    with pytest.raises(ValueError, match="computed for something else"):
        HiddenStateSource("offline", tiny_target, layers, cache_dir=tmp_path / "hs", dtype=dtype,
                          shard_tokens=40, capture_batch_size=4).prepare(ds, progress=False)

    # the stored tensors are the target's: features at HF hidden_states indices, last_hidden -> logits
    row = 0
    ids = a[0]["input_ids"][row, : int(a[0]["attention_mask"][row].sum())]
    with torch.no_grad():
        out = tiny_target.model(input_ids=ids[None], output_hidden_states=True)
    n = ids.numel()
    for k, layer in enumerate(layers):
        assert torch.allclose(a[0]["features"][row, :n, k].double(), out.hidden_states[layer][0].double(), atol=1e-5)
    logits = tiny_target.lm_head(a[0]["last_hidden"][row, :n].to(tiny_target.dtype))
    assert torch.allclose(logits, out.logits[0], atol=1e-6)
    # right padding: zeros and no attention / loss past each example's end
    short = int(a[0]["attention_mask"].sum(1).argmin())
    m = int(a[0]["attention_mask"][short].sum())
    if m < a[0]["input_ids"].shape[1]:
        assert not a[0]["loss_mask"][short, m:].any() and not a[0]["features"][short, m:].any()


def test_batched_capture_runs_on_the_engine(tmp_path, monkeypatch):
    """capture_batch_size > 1 on a target that decodes on the runtime's engine: the offline capture
    runs the engine's chunked prefill (several examples per forward, no padding), with states equal to
    HF's one forward per example up to bf16 rounding, a manifest header of its own (never mixed with
    an HF capture), the engine's forward actually called; an HF target keeps HF's path."""
    from tiny_models import tiny_llama
    from specfoundry.runtime.serving import slots
    from specfoundry.train.features import capture_backend

    ds = _token_dataset(n=9, seed=4)
    eng = tiny_llama(2, vocab=64, hidden=64, layers=3, dtype=torch.bfloat16)
    hf = tiny_llama(2, vocab=64, hidden=64, layers=3, dtype=torch.bfloat16, backend="hf")
    assert capture_backend(eng, 4) == "engine" and capture_backend(eng, 1) == "hf" and capture_backend(hf, 4) == "hf"
    layers = (1, 2, eng.num_layers)
    calls = []
    real = slots.forward_mixed
    monkeypatch.setattr(slots, "forward_mixed", lambda *a, **k: calls.append(len(a[4])) or real(*a, **k))
    src = HiddenStateSource("offline", eng, layers, cache_dir=tmp_path / "eng", shard_tokens=60, capture_batch_size=4)
    src.prepare(ds, progress=False)
    assert calls and max(calls) == 4 and sum(calls) == len(ds)  # groups of 4 examples per forward
    assert json.loads((tmp_path / "eng" / "manifest.json").read_text())["header"]["capture"] == "engine"
    ref = HiddenStateSource("online", hf, layers)
    for x, y in zip(src.batches(ds, 3, seed=1, epoch=0), ref.batches(ds, 3, seed=1, epoch=0)):
        assert torch.equal(x["input_ids"], y["input_ids"])
        for k in ("features", "last_hidden"):
            assert x[k].dtype == y[k].dtype == torch.bfloat16
            diff = (x[k].float() - y[k].float()).norm() / y[k].float().norm()
            assert diff < 2e-2, (k, float(diff))  # bf16 kernels: rounding, not a different state
            assert not x[k][x["attention_mask"] == 0].any()  # padding stays zero
    calls.clear()
    HiddenStateSource("offline", hf, layers, cache_dir=tmp_path / "hf", shard_tokens=60,
                      capture_batch_size=4).prepare(ds, progress=False)
    assert not calls and "capture" not in json.loads((tmp_path / "hf" / "manifest.json").read_text())["header"]


def test_batch_order_and_start_step_resume(tiny_target):
    ds = _token_dataset(n=11)
    src = HiddenStateSource("online", tiny_target, (1, 3))
    full = list(src.batches(ds, 3, seed=1, epoch=0))
    assert len(full) == src.num_batches(ds, 3) == 4
    assert sorted(i for b in full for i in b["example_ids"].tolist()) == ds["id"]
    _same_batches(list(src.batches(ds, 3, seed=1, epoch=0, start_step=2)), full[2:])
    assert batch_order(11, 3, seed=1, epoch=0) == batch_order(11, 3, seed=1, epoch=0)
    assert batch_order(11, 3, seed=1, epoch=1) != batch_order(11, 3, seed=1, epoch=0)
    # two ranks split the epoch's batches between them
    r0 = [b["example_ids"].tolist() for b in src.batches(ds, 3, seed=1, epoch=0, rank=0, world_size=2)]
    r1 = [b["example_ids"].tolist() for b in src.batches(ds, 3, seed=1, epoch=0, rank=1, world_size=2)]
    assert r0 + r1 != [] and sorted(sum(r0 + r1, [])) == ds["id"]


def test_offline_prepare_resumes_and_refuses_other_targets(tiny_target, tmp_path, monkeypatch):
    from safetensors import torch as st

    ds = _token_dataset(n=8)
    cache = tmp_path / "hs"
    real_save = st.save_file
    saved = []

    def failing_save(tensors, path, metadata=None):
        if len(saved) == 1:
            raise KeyboardInterrupt("simulated kill")
        saved.append(path)
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", failing_save)
    src = HiddenStateSource("offline", tiny_target, (1, 2), cache_dir=cache, shard_tokens=30)
    with pytest.raises(KeyboardInterrupt):
        src.prepare(ds, progress=False)
    manifest = json.loads((cache / "manifest.json").read_text())
    assert not manifest["complete"] and list(manifest["shards"]) == ["0"]
    with pytest.raises(RuntimeError, match="prepare"):
        next(src.batches(ds, 2, seed=0, epoch=0))

    saved.clear()
    def counting_save(tensors, path, metadata=None):
        saved.append(path)
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", counting_save)
    src.prepare(ds, progress=False)
    n_shards = len(json.loads((cache / "manifest.json").read_text())["shards"])
    assert len(saved) == n_shards - 1  # shard 0 was not recomputed
    online = HiddenStateSource("online", tiny_target, (1, 2))
    _same_batches(list(src.batches(ds, 3, seed=0, epoch=0)), list(online.batches(ds, 3, seed=0, epoch=0)))

    with pytest.raises(ValueError, match="feature_layers"):
        HiddenStateSource("offline", tiny_target, (1, 3), cache_dir=cache).prepare(ds, progress=False)
    from tiny_models import tiny_llama

    with pytest.raises(ValueError, match="target"):
        HiddenStateSource("offline", tiny_llama(1), (1, 2), cache_dir=cache).prepare(ds, progress=False)


def test_dataset_hash_is_one_pass_per_dataset_object():
    # the run names its feature store by the hash and the store's manifest records it: the
    # second ask must not read every token again, while other data must hash differently
    from datasets import Dataset

    from specfoundry.train.features import dataset_hash

    rows = {"id": [0, 1, 2], "input_ids": [[1, 2, 3], [4, 5], [6]], "loss_mask": [[0, 1, 1], [1, 1], [1]]}
    ds = Dataset.from_dict(rows)
    reads = []
    real = Dataset.__getitem__

    class Counting(Dataset):
        def __getitem__(self, key):
            reads.append(key)
            return real(self, key)

    ds.__class__ = Counting
    first = dataset_hash(ds)
    assert len(reads) == 3
    assert dataset_hash(ds) == first and len(reads) == 3  # remembered, not re-read
    other = Dataset.from_dict({**rows, "input_ids": [[1, 2, 3], [4, 5], [7]]})
    assert dataset_hash(other) != first
    assert dataset_hash(Dataset.from_dict(rows)) == first  # content, not identity, decides the value
    listed = [dict(zip(rows, vals)) for vals in zip(*rows.values())]
    assert dataset_hash(listed) == first  # plain lists (no weak reference) still hash, every time


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_generation_on_the_engine_equals_the_hf_path(temperature):
    """Unequal prompts, rows finishing at different steps, greedy and sampled with one seed: the
    engine's continuous batching (a finished prompt's slot refilled by the next, prefilled in the
    decode rows' forward) gives the tokens of the HF path's static left-padded batch, with any
    number of slots: each prompt draws from its own random stream."""
    from tiny_models import tiny_llama
    from specfoundry.runtime.engine import LlamaEngine
    from specfoundry.train.data import generate_batched

    hf = tiny_llama(0, backend="hf").model
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [9, 9, 9, 9, 9], [8, 1], [3, 3], [17, 4, 60, 2]]
    kw = dict(max_new_tokens=14, stop_ids=[31], temperature=temperature, top_p=0.9, seed=3, min_new_tokens=2)
    ref, ref_fin = generate_batched(hf, prompts, batch_size=len(prompts), **kw)
    engine = LlamaEngine(hf)
    for slots in (1, 2, 3, len(prompts)):
        got, fin = generate_batched(engine, prompts, batch_size=slots, **kw)
        assert got == ref and fin == ref_fin, slots
    assert any(fin) and not all(fin), "the test needs rows that stop early and rows that do not"
    assert all(len(g) >= 2 for g in ref), "min_new_tokens holds the stop tokens back"
    assert len({len(g) for g in ref}) > 2, "rows must finish at different steps (slots are refilled mid-run)"
    if temperature > 0:  # another seed draws other tokens (the streams are really used)
        assert generate_batched(engine, prompts, batch_size=3, **{**kw, "seed": 4})[0] != ref


def test_a_greedy_and_sampled_mix_gives_each_prompt_its_greedy_or_its_sampled_answer():
    """responses.sampled_fraction: in one batch, the greedy prompts get exactly the greedy run's
    tokens and the sampled ones exactly what they draw when every prompt samples (own streams);
    which prompts sample is decided by their text, at about the asked share."""
    from tiny_models import tiny_llama
    from specfoundry.runtime.engine import LlamaEngine
    from specfoundry.train.data import generate_batched
    from specfoundry.train.distill import sampled_in_mix

    engine = LlamaEngine(tiny_llama(0, backend="hf").model)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [9, 9, 9, 9, 9], [8, 1], [3, 3]]
    kw = dict(max_new_tokens=12, stop_ids=[31], top_p=0.9, seed=3, batch_size=4)
    greedy, _ = generate_batched(engine, prompts, temperature=0.0, **kw)
    sampled, _ = generate_batched(engine, prompts, temperature=1.0, **kw)
    assert all(g != s for g, s in zip(greedy[:3], sampled[:3])), "the test needs rows where sampling differs"
    mix = [True, False, True, False, False, True]
    got, _ = generate_batched(engine, prompts, temperature=1.0, sampled=mix, **kw)
    assert got == [s if m else g for g, s, m in zip(greedy, sampled, mix)]
    with pytest.raises(ValueError, match="6 prompts"):
        generate_batched(engine, prompts, temperature=1.0, sampled=mix[:5], **kw)

    texts = [f"prompt number {i}" for i in range(2000)]
    share = sum(sampled_in_mix(t, 0.3) for t in texts) / len(texts)
    assert 0.26 < share < 0.34
    assert [sampled_in_mix(t, 0.3) for t in texts[:50]] == [sampled_in_mix(t, 0.3) for t in texts[:50]]
    assert not any(sampled_in_mix(t, 0.0) for t in texts) and all(sampled_in_mix(t, 1.0) for t in texts)


def test_a_sampled_mix_needs_greedy_for_the_rest():
    from specfoundry.train.distill import self_distill

    with pytest.raises(ValueError, match="temperature must be 0"):
        self_distill(["hi"], None, responses_cfg={"temperature": 0.7, "sampled_fraction": 0.5}, cache_dir="/nonexistent")


def test_batch_order_groups_rows_of_similar_length():
    from specfoundry.train.features import LENGTH_GROUP

    g = torch.Generator().manual_seed(0)
    n, bs = 8 * LENGTH_GROUP * 2 + 5, 8
    lengths = torch.randint(20, 300, (n,), generator=g).tolist()
    grouped = batch_order(n, bs, seed=3, epoch=0, lengths=lengths)
    plain = batch_order(n, bs, seed=3, epoch=0)
    # every row once, deterministic, another order in another epoch
    assert sorted(i for b in grouped for i in b) == list(range(n))
    assert grouped == batch_order(n, bs, seed=3, epoch=0, lengths=lengths)
    assert grouped != batch_order(n, bs, seed=3, epoch=1, lengths=lengths)

    def padded(order):
        return sum(max(lengths[i] for i in b) * len(b) for b in order) / sum(lengths)

    assert padded(plain) > 1.2 and padded(grouped) < 1.08
    # the batches' order is shuffled, not sorted by length
    longest = [max(lengths[i] for i in b) for b in grouped]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    assert len(batch_order(n, bs, seed=3, epoch=0, lengths=lengths, drop_last=True)) == n // bs
    with pytest.raises(ValueError, match="lengths"):
        batch_order(n, bs, seed=3, epoch=0, lengths=lengths[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generation_keeps_the_states_a_capture_would_compute(dtype):
    """state_layers: every prompt's states, prompt and answer up to its last token (a finished row
    stays one forward more for it), equal to the engine's capture of the same tokens (fp32 to float
    rounding, bf16 within its rounding), with the tokens of a run that keeps none, for any number
    of slots (rows finish at different steps, slots are refilled); a HF model cannot keep them."""
    from tiny_models import tiny_llama
    from specfoundry.train.data import generate_batched

    t = tiny_llama(0, dtype=dtype)
    eng = t._engine()
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42], [9, 9, 9, 9, 9], [8, 1], [3, 3], [17, 4, 60, 2]]
    layers = (1, 2, t.num_layers)
    kw = dict(max_new_tokens=14, stop_ids=[31], temperature=0.0, seed=3, min_new_tokens=2)
    capture = HiddenStateSource("offline", t, layers[:2], cache_dir="unused", capture_batch_size=4)
    bound = 1e-5 if dtype == torch.float32 else 3e-2
    for slots in (1, 3, len(prompts)):
        ref, ref_fin = generate_batched(eng, prompts, batch_size=slots, **kw)
        kept = {}
        new, fin = generate_batched(eng, prompts, batch_size=slots, state_layers=layers,
                                    on_states=kept.__setitem__, **kw)
        assert new == ref and fin == ref_fin, slots
        assert any(fin) and not all(fin) and len({len(g) for g in new}) > 2
        assert sorted(kept) == list(range(len(prompts)))
        for i, (f, h) in enumerate(capture._compute_rows_engine([p + g for p, g in zip(prompts, new)])):
            s = kept[i]
            assert s.shape == (len(prompts[i]) + len(new[i]), 3, t.hidden_size) and s.dtype == dtype
            for got, want in ((s[:, :2], f), (s[:, 2], h)):
                err = (got.double() - want.double()).norm() / want.double().norm()
                assert err < bound, (slots, i, float(err))
            # the last position too (the extra forward): computed, not left empty, and equal to the capture's
            assert (s[-1].double() - f.new_zeros(1).double()).abs().sum() > 0
            err_last = (s[-1, 2].double() - h[-1].double()).norm() / h[-1].double().norm()
            assert err_last < 3 * bound
    # sampled answers too: a closing row's extra draw comes from its own finished prompt's stream
    sampled = {**kw, "temperature": 1.0, "top_p": 0.9}
    for slots in (1, 3):
        assert generate_batched(eng, prompts, batch_size=slots, state_layers=layers, on_states=lambda i, s: None,
                                **sampled) == generate_batched(eng, prompts, batch_size=slots, **sampled), slots
    with pytest.raises(ValueError, match="engine"):
        generate_batched(t.model, prompts, max_new_tokens=4, state_layers=layers, on_states=lambda i, s: None)


def test_self_distilled_states_fill_the_offline_store_without_a_capture(tmp_path, monkeypatch):
    """self_distill with state_layers writes each answered prompt's states; the offline store built
    with them (a header of its own) captures no example whose file holds its tokens, reads the
    prefix of an example truncated to max_seq_len, and captures the ones whose file is missing,
    damaged or for other tokens; its batches equal a captured-only store's to float rounding."""
    from tiny_models import tiny_llama
    from specfoundry.train.distill import states_dir
    from specfoundry.train.genstates import GenerationStates, state_layers_for

    t = tiny_llama(1, dtype=torch.float32)
    layers = (1, 3)
    keep = state_layers_for(layers, t.num_layers)
    assert keep == (1, 3, t.num_layers)
    f = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": " ".join(str(10 + (i * 7 + j) % 50) for j in range(3 + i))}
                                            for i in range(8)])
    resp = {"max_new_tokens": 10, "batch_size": 3, "chunk_size": 4}
    kw = dict(responses_cfg=resp, max_seq_len=18, min_response_tokens=4, cache_dir=tmp_path / "cache", seed=1)
    ds, _ = build_dataset([{"source": "file", "path": str(f)}], t, state_layers=keep, **kw)
    root = states_dir(tmp_path / "cache", t, resp, 1, keep)
    assert len(list(root.glob("*.safetensors"))) == len(ds) == 8
    assert any(len(x) == 18 for x in ds["input_ids"]), "the test needs an example truncated to max_seq_len"

    calls = []
    real = HiddenStateSource._compute_rows
    monkeypatch.setattr(HiddenStateSource, "_compute_rows",
                        lambda self, rows, bar=None: calls.append(len(rows)) or real(self, rows, bar))
    states = GenerationStates(root, layers, t.num_layers)
    src = HiddenStateSource("offline", t, layers, cache_dir=tmp_path / "gen", shard_tokens=40, capture_batch_size=4,
                            states=states)
    src.prepare(ds, progress=False)
    assert sum(calls) == 0 and states.found == len(ds)
    assert json.loads((tmp_path / "gen" / "manifest.json").read_text())["header"]["states"] == "generation"
    ref = HiddenStateSource("offline", t, layers, cache_dir=tmp_path / "cap", shard_tokens=40, capture_batch_size=4)
    ref.prepare(ds, progress=False)
    assert sum(calls) == len(ds)
    for x, y in zip(src.batches(ds, 3, seed=0, epoch=0), ref.batches(ds, 3, seed=0, epoch=0)):
        assert torch.equal(x["input_ids"], y["input_ids"])
        for k in ("features", "last_hidden"):
            assert (x[k] - y[k]).norm() / y[k].norm() < 1e-5, k
            assert not x[k][x["attention_mask"] == 0].any()
    with pytest.raises(ValueError, match="computed for something else"):  # never mixed with a captured store
        HiddenStateSource("offline", t, layers, cache_dir=tmp_path / "cap", shard_tokens=40, capture_batch_size=4,
                          states=states).prepare(ds, progress=False)

    # a missing file, a damaged one and one for other tokens: those three are captured, the rest read
    from specfoundry.train.genstates import _path, write_states

    _path(root, ds[0]["prompt"]).unlink()
    _path(root, ds[1]["prompt"]).write_bytes(b"not a safetensors file")
    other = torch.zeros(len(ds[2]["input_ids"]), len(keep), t.hidden_size)
    write_states(root, ds[2]["prompt"], [x + 1 for x in ds[2]["input_ids"]], other, keep)
    calls.clear()
    again = GenerationStates(root, layers, t.num_layers)
    src2 = HiddenStateSource("offline", t, layers, cache_dir=tmp_path / "gen2", shard_tokens=40, capture_batch_size=4,
                             states=again)
    src2.prepare(ds, progress=False)
    assert sum(calls) == 3 and again.found == len(ds) - 3
    for x, y in zip(src2.batches(ds, 3, seed=0, epoch=0), ref.batches(ds, 3, seed=0, epoch=0)):
        for k in ("features", "last_hidden"):
            assert (x[k] - y[k]).norm() / y[k].norm() < 1e-5, k
    # a store for other layers reads none of them (the files hold 1, 3 and the last only)
    assert GenerationStates(root, (2,), t.num_layers).get(ds[3]["prompt"], ds[3]["input_ids"]) is None
