"""``specfoundry bench``: prompt loaders, a tiny-model run end to end (schema-valid report.json,
report.md, non-empty PNGs), a planted non-lossless method flagged as a failure, speed-up ratios
from interleaved per-prompt timings, and clear errors for bad input."""

import json
import statistics
import string
import tomllib
from pathlib import Path

import pytest
import torch

from specfoundry.bench.cli import write_report
from specfoundry.bench.measure import run_bench
from specfoundry.bench.methods import Method, MethodFactory, RunResult, generator_runner
from specfoundry.bench.prompts import BUILTIN, load_prompts, select
from specfoundry.bench.report import FAIL_MARK, summarize, validate_report
from specfoundry.runtime import SpeculativeGenerator, load_target
from specfoundry.runtime.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("single_thread")

ROOT = Path(__file__).resolve().parents[1]
SHARED_EVAL = ROOT.parent / "shared" / "data" / "eval"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_chat_model_dir(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with a character-level tokenizer and a chat template, saved as a local
    HF directory, so the text-prompt path (chat template, HF generate peers) runs without a hub."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in sorted(set(string.printable) - set("\x0b\x0c")):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.5, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_chat_model_dir(tmp_path_factory.mktemp("tiny-chat") / "model")


@pytest.fixture(scope="module")
def tiny_chat(tiny_dir):
    return load_target(str(tiny_dir), dtype=torch.float64)


# -- prompts --------------------------------------------------------------------------------
def test_builtin_prompt_set_covers_six_categories_of_eight():
    prompts = load_prompts(None)
    cats = {}
    for p in prompts:
        cats.setdefault(p.category, []).append(p)
    assert {"conversation", "code", "math", "summarization", "translation", "retrieval_qa"} <= set(cats)
    assert all(len(v) >= 8 for v in cats.values())
    assert any(len(p.turns) == 2 for p in cats["conversation"])  # the multi-turn path is exercised
    assert len({p.question_id for p in prompts}) == len(prompts)
    assert all(p.dataset == "builtin" for p in prompts)
    two = select(prompts, ["math", "builtin:code"], limit=3)
    assert [p.category for p in two] == ["code"] * 3 + ["math"] * 3


@pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="../shared/data/eval is absent")
@pytest.mark.parametrize("name,category", [("spec_bench", "translation"), ("mt_bench", "writing"),
                                           ("humaneval", "code"), ("gsm8k", "math")])
def test_shared_eval_files_load(name, category):
    prompts = load_prompts(SHARED_EVAL / name / "question.jsonl")
    assert len(prompts) == (480 if name == "spec_bench" else 80)
    assert all(p.dataset == name and p.turns and all(t.strip() for t in p.turns) for p in prompts)
    assert category in {p.category for p in prompts}
    if name in ("spec_bench", "mt_bench"):
        assert any(len(p.turns) == 2 for p in prompts)


def test_original_humaneval_gsm8k_and_plain_rows(tmp_path):
    f = tmp_path / "mixed.jsonl"
    rows = [{"task_id": "HumanEval/0", "prompt": "def f(x):\n    \"\"\"doc\"\"\"\n", "canonical_solution": "..."},
            {"question": "What is 2+3?", "answer": "#### 5"},
            {"prompt": "Say hi", "category": "chat", "id": "p1"},
            {"conversations": [{"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi"}]}]
    # a U+2028 inside a string must not split the row (lines split on \n only)
    rows[2]["prompt"] = "Say\u2028hi"
    f.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    ps = load_prompts(f)
    assert [(p.category, p.question_id) for p in ps] == [("code", "HumanEval/0"), ("math", "1"), ("chat", "p1"),
                                                         ("conversation", "3")]
    assert ps[2].turns == ("Say\u2028hi",)


@pytest.mark.parametrize("content,match", [
    ('{"question_id": 1, "turns": ["a"]}\n{oops\n', r"bad\.jsonl:2: not valid JSON"),
    ('{"question_id": 1, "turns": []}\n', r"bad\.jsonl:1: 'turns' must be a non-empty list"),
    ('{"foo": 1}\n', r"bad\.jsonl:1: a row needs 'turns'"),
    ('[1, 2]\n', r"bad\.jsonl:1: each row must be a JSON object"),
    ('{"question_id": 1, "turns": ["a"]}\n{"question_id": 1, "turns": ["b"]}\n', "duplicate question id"),
])
def test_bad_prompt_rows_are_one_line_errors(tmp_path, content, match):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        load_prompts(f)
    assert "\n" not in str(err.value)


def test_prompt_selection_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown category"):
        select(load_prompts(None), ["poetry"])
    with pytest.raises(ValueError, match="--limit"):
        select(load_prompts(None), None, 0)


# -- methods --------------------------------------------------------------------------------
def test_method_specs_and_errors(tiny_chat, tmp_path):
    f = MethodFactory(tiny_chat)
    assert f.build("ngram:chain@3").name == "ngram:chain@3"
    assert f.build("eagle3").name == "eagle3:dynamic@5"
    assert "untrained random-init head" in f.build("medusa:static").label
    assert "untrained layer-subset draft" in f.build("hf-assisted").label
    look = f.build("eagle3:lookup@3")  # the head's chain of 3, lookup chains up to 5
    assert look.name == "eagle3:lookup@3" and "prompt lookup first (>= 2-token match, <= 5 tokens), else chain" in look.label
    assert "else adaptive dynamic" in f.build("eagle3:lookup-adaptive").label
    tree = f.build("eagle3:lookup-tree@2/4")  # a fixed small tree behind prompt lookup
    assert tree.name == "eagle3:lookup-tree@2/4" and "else a 4-node tree" in tree.label
    assert f.build("eagle3:dynamic@3/6").name == "eagle3:dynamic@3/6"
    inner = f._drafter(f.sources["eagle3"], "dynamic", 2, 4)
    assert (inner.tree, inner.depth, inner.total_tokens, inner.top_k) == ("dynamic", 2, 4, 3)
    for spec, match in [("nope", "unknown method 'nope'"), ("ngram:dynamic", "unknown shape 'dynamic'"),
                        ("eagle3:chain@2/4", "@K/N is for the tree shapes"), ("eagle3:lookup-tree@2", "needs @K/N"),
                        ("eagle3:lookup-tree@2/3", "N must be in"), ("ngram:lookup-tree@2/4", "unknown shape"),
                        ("eagle3:chain@0", "draft depth must be >= 1"), ("plain:chain", "plain takes no shape"),
                        ("vllm", "out-of-process peer"), ("bad spec!", "bad method spec")]:
        with pytest.raises(ValueError, match=match):
            f.build(spec)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MethodFactory(tiny_chat, [tmp_path / "runs" / "nope"])
    (tmp_path / "run" / "speculator").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no speculator/config.json"):
        MethodFactory(tiny_chat, [tmp_path / "run"])


def test_draft_run_directory_becomes_the_draft_source(tiny_chat, tmp_path):
    # a distilled-draft run holds an HF model directory in speculator/
    tiny_chat.model.save_pretrained(tmp_path / "runs" / "draft-x" / "speculator")
    f = MethodFactory(tiny_chat, [tmp_path / "runs" / "draft-x"])
    assert f.sources["draft"].trained and "draft:adaptive" in f.default_specs()
    assert "our distilled draft (draft-x)" in f.build("hf-assisted").label


# -- end to end -----------------------------------------------------------------------------
def test_tiny_bench_run_writes_valid_report_markdown_and_plots(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    methods = ("plain,ngram:chain,ngram:adaptive,draft:chain@3,eagle3:dynamic,eagle3:chain@3,eagle3:lookup-adaptive,"
               "eagle3:lookup-tree@2/4,medusa:static")
    rc = cli_main(["bench", "--target", str(tiny_dir), "--dtype", "float64", "--categories", "conversation,math",
                   "--limit", "1", "--max-new-tokens", "10", "--temperature", "0", "1", "--methods", methods,
                   "--peers", "hf,hf-lookup,hf-assisted,llamacpp", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == []
    assert report["passed"] and report["failures"] == []
    names = [m["name"] for m in report["methods"]]
    assert names[0] == "plain" and {"hf", "hf-lookup@5", "hf-assisted", "eagle3:dynamic@5", "eagle3:lookup-tree@2/4",
                                    "medusa:static@4"} <= set(names)
    # conversation prompt 1 has two turns, math one: 3 turns x 2 temperatures per method
    assert len(report["records"]) == len(names) * 3 * 2
    # llama.cpp: not installed here, or installed but the tiny target has no GGUF
    assert any(u["name"] == "llamacpp" and ("not installed" in u["reason"] or "needs a GGUF" in u["reason"])
               for u in report["unavailable"]), report["unavailable"]
    for r in report["records"]:
        status = r["check"]["status"]
        if r["temperature"] > 0 or r["method"] == "plain":
            assert status == "n/a"
        else:
            assert status in ("identical", "near_tie"), r
    for tkey in ("T=0", "T=1"):
        block = report["summary"][tkey]
        assert set(block["by_category"]) == {"builtin:conversation", "builtin:math"}
        for name, row in block["overall"].items():
            if name.split(":")[0] in ("ngram", "draft", "eagle3", "medusa"):
                # pooled per-position counts are exact: their sum is the number of accepted tokens
                assert sum(row["passed"]) == row["accepted"] and row["drafted"] >= row["accepted"]
                assert row["tau"] == pytest.approx(row["new_tokens"] / row["target_forwards"])
                assert row["expected_tau"] is not None and row["leviathan_tau"] is not None
                sp = row["step_ms"]  # the per-step split adds up to at most the wall clock per forward
                assert sp["verify"] > 0 and sp["draft"] > 0 and sp["other"] >= 0
                per_fwd = sum(r["seconds"] - r["prefill_seconds"] for r in report["records"]
                              if r["method"] == name and f"T={r['temperature']:g}" == tkey) * 1000 / row["target_forwards"]
                assert sp["draft"] + sp["verify"] + sp["other"] == pytest.approx(per_fwd)
    for r in report["records"]:  # the decode speed-up: the per-token ratio with both calls' prefill taken out
        if r["method"] == "plain":
            assert r["decode_speed_up"] == pytest.approx(1.0)
        elif r.get("prefill_seconds") is not None:
            assert r["decode_speed_up"] == pytest.approx(((r["plain_seconds"] - r["plain_prefill_seconds"])
                                                          / r["plain_new_tokens"])
                                                         / ((r["seconds"] - r["prefill_seconds"]) / r["new_tokens"]))
        else:  # HF peers report no prefill
            assert r["decode_speed_up"] is None
    row = report["summary"]["T=0"]["overall"]["eagle3:lookup-tree@2/4"]
    assert row["median_decode_speed_up"] == pytest.approx(statistics.median(
        r["decode_speed_up"] for r in report["records"] if r["method"] == "eagle3:lookup-tree@2/4" and r["temperature"] == 0))
    assert report["summary"]["T=0"]["overall"]["plain"]["tau"] == 1.0
    md = (out / "report.md").read_text()
    assert "## T=0: overall" in md and "## T=1: overall" in md and "speed-up (tau) by category" in md
    assert "builtin:conversation" in md and "Leviathan" in md and FAIL_MARK not in md and "per-step split" in md
    # the weight-streaming floor and the warm-up / time-to-first-token table (issue 11's report items)
    from specfoundry.bench.floor import streamed_weight_bytes

    fl = report["floor"]
    assert fl["weight_bytes"] == streamed_weight_bytes(load_target(str(tiny_dir), dtype=torch.float64).model)
    assert fl["read_gbs"] > 0 and fl["floor_ms"] == pytest.approx(1000 * fl["weight_bytes"] / (fl["read_gbs"] * 1e9))
    # read before and after the run; the floor takes the higher bandwidth (the best the machine showed)
    assert len(fl["readings_gbs"]) == 2 and fl["read_gbs"] == max(fl["readings_gbs"]) > 0
    assert "the higher of two readings, before and after the run: " + " / ".join(
        f"{g:.1f}" for g in fl["readings_gbs"]) in md
    assert "Weight-streaming floor" in md and "x the floor" in md and "warm-up and time to first token" in md
    assert f"| {row['median_decode_speed_up']:.2f}x |" in md and "*decode speed-up*" in md
    sp = report["summary"]["T=0"]["overall"]["plain"]["step_ms"]  # the floor against a decode step, prefill apart
    step = sp["draft"] + sp["verify"] + sp["other"]
    assert f"plain decoding {step:.1f} ms per decode step" in md and f"= {step / fl['floor_ms']:.2f}x the floor" in md
    warm = {m["name"]: m.get("warmup_seconds") for m in report["methods"]}
    assert all(warm[m["name"]] > 0 for m in report["methods"] if m["interleaved"])
    assert report["summary"]["T=0"]["overall"]["plain"]["ttft_s"] > 0
    assert report["environment"]["git_commit"] and report["environment"]["torch"] == torch.__version__
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["acceptance_by_position.png", "speedup_by_category.png", "tau_vs_draft_length.png"]
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    # speed-up against the fastest HF mode, paired prompt by prompt: that mode itself is 1.0x
    for block in report["summary"].values():
        best = block["best_hf"]
        assert best in ("hf", "hf-lookup@5", "hf-assisted")
        assert block["overall"][best]["median_speed_up_vs_best_hf"] == pytest.approx(1.0)
        assert all(row["median_speed_up_vs_best_hf"] is not None for row in block["overall"].values())
    assert "vs best HF" in md
    # --render rebuilds the tables from the stored records without running anything
    (out / "report.md").write_text("stale")
    assert cli_main(["bench", "--render", str(out)]) == 0
    assert (out / "report.md").read_text() == md  # same records, same environment: the same report


class _AlteringGenerator(SpeculativeGenerator):
    """A planted non-lossless generator: flips one emitted token of the real speculative output."""

    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        if out.token_ids:
            i = min(3, len(out.token_ids) - 1)
            out.token_ids[i] = (out.token_ids[i] + 1) % self.target.vocab_size
        return out


def _methods(target):
    f = MethodFactory(target)
    planted = Method("planted", "ngram with one altered token", "ours",
                     generator_runner(_AlteringGenerator(target, f._drafter(f.sources["ngram"], "chain", 3), adaptive=False)),
                     draft_depth=3)
    return f, planted


def test_planted_non_lossless_method_is_flagged(tiny_chat, tmp_path):
    f, planted = _methods(tiny_chat)
    prompts = select(load_prompts(None), ["code", "math"], limit=1)
    methods = [f.plain(), f.build("ngram:chain@3"), planted]
    raw = run_bench(tiny_chat, prompts, methods, temperatures=[0.0], max_new_tokens=8, progress=False)
    described = [m.describe() for m in methods]
    rc = write_report(tmp_path, raw, described, [], {
        "target": "tiny", "dtype": "float64", "temperatures": [0.0], "max_new_tokens": 8, "repeats": 1, "seed": 0,
        "stop_at_eos": True, "datasets": ["builtin"], "limit": 1})
    assert rc == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert validate_report(report) == []
    assert report["passed"] is False
    assert {x["method"] for x in report["failures"]} == {"planted"} and len(report["failures"]) == 2
    assert all(x["first_divergence"] is not None and x["first_divergence"] <= 3 for x in report["failures"])
    assert report["summary"]["T=0"]["overall"]["planted"]["failures"] == 2
    assert report["summary"]["T=0"]["overall"]["ngram:chain@3"]["failures"] == 0
    md = (tmp_path / "report.md").read_text()
    assert 'style="color:red"' in md and "FAIL" in md and "lossless violations" in md
    assert md.count(FAIL_MARK) >= 3  # verdict, table cell, section heading
    assert "| `planted` |" in md


def test_plain_runs_on_the_fastest_products_and_speculation_is_checked_on_its_own(tiny_chat, tmp_path):
    """Where plain decoding is fastest on other products than the engine chose (AMX vs AVX-512 BF16),
    plain runs on those, plain@<engine kernel> on the engine's, and the speculative methods' greedy
    outputs are checked against the latter (the same arithmetic). Kernels available everywhere stand in."""
    from specfoundry.bench.plain_kernels import apply_plain_kernels

    f, _ = _methods(tiny_chat)
    eng = tiny_chat._engine()
    own = eng.kernels
    # products other than the engine's own (which the timed choice may make either of these; CI's chose aten)
    other = next(k for k in [("aten", "aten"), ("gemv_t", "gemv_t")] if k != own)
    seen = []
    forward = eng.forward

    def spy(*args, **kwargs):
        seen.append(eng.kernels)
        return forward(*args, **kwargs)

    eng.forward = spy
    try:
        choice = {"engine": own, "plain": other, "ms_per_token": {}}
        methods = apply_plain_kernels([f.plain(), f.build("ngram:chain@3")], tiny_chat, choice)
        assert [m.name for m in methods] == ["plain", f"plain@{own[0]}", "ngram:chain@3"]
        assert methods[2].reference == f"plain@{own[0]}" and methods[1].check == "info"
        seen.clear()
        methods[0].runner(tiny_chat.encode_chat([{"role": "user", "content": "def f(x):"}]), 4, 0.0, 0, True)
        assert seen and set(seen) == {other} and eng.kernels == own  # restored after the call
        seen.clear()
        methods[2].runner(tiny_chat.encode_chat([{"role": "user", "content": "def f(x):"}]), 4, 0.0, 0, True)
        assert seen and set(seen) == {own}
        prompts = select(load_prompts(None), ["code", "math"], limit=1)
        raw = run_bench(tiny_chat, prompts, methods, temperatures=[0.0], max_new_tokens=8, progress=False)
    finally:
        del eng.forward
    checks = [r["check"] for r in raw["records"] if r["method"] == "ngram:chain@3"]
    assert len(checks) == 2 and all(c["status"] == "identical" and c["reference"] == f"plain@{own[0]}" for c in checks)
    # the report also counts speed-ups against the faster of the two plain rows in the run, paired per
    # prompt (the pre-run timing can pick the slower: thirty-eighth session); planted per-prompt speed-ups
    from specfoundry.bench.report import summarize

    recs = [dict(r) for r in raw["records"]]
    for r in recs:
        r["speed_up"] = {"plain": 1.0, f"plain@{own[0]}": 2.0}.get(r["method"], 3.0)
    block = summarize(recs, [m.describe() for m in methods])["T=0"]
    assert block["best_plain"] == f"plain@{own[0]}"
    assert block["overall"]["ngram:chain@3"]["median_speed_up_vs_best_plain"] == pytest.approx(1.5)
    assert block["overall"][f"plain@{own[0]}"]["median_speed_up_vs_best_plain"] == pytest.approx(1.0)
    assert block["overall"]["plain"]["median_speed_up_vs_best_plain"] == pytest.approx(0.5)
    for r in recs:
        r["speed_up"] = 1.0 if r["method"] != "ngram:chain@3" else 3.0  # plain the faster: no second reference
    assert summarize(recs, [m.describe() for m in methods])["T=0"]["best_plain"] == "plain"
    # nothing to change where plain decoding is fastest on the engine's own products
    same = [f.plain(), f.build("ngram:chain@2")]
    assert apply_plain_kernels(same, tiny_chat, {"engine": own, "plain": own, "ms_per_token": {}}) == same
    assert same[1].reference == "plain"


def test_plain_kernel_choice_times_every_option_and_restores_the_engine(tiny_chat, monkeypatch):
    from specfoundry.bench.plain_kernels import plain_kernel_choice

    eng = tiny_chat._engine()
    own = eng.kernels
    assert plain_kernel_choice(tiny_chat, tiny_chat.encode_chat([{"role": "user", "content": "x = 1"}]))["ms_per_token"] == {}  # float64: one option
    options = [("aten", "aten"), own]
    monkeypatch.setattr(type(eng), "layer_kernel_options", lambda self, chosen=None: list(options))
    choice = plain_kernel_choice(tiny_chat, tiny_chat.encode_chat([{"role": "user", "content": "x = 1"}]), tokens=4, rounds=1)
    assert choice["engine"] == own and choice["plain"] in options and eng.kernels == own
    assert set(choice["ms_per_token"]) == set(options) and all(ms > 0 for ms in choice["ms_per_token"].values())


def test_speed_up_is_computed_from_interleaved_per_prompt_timings(tiny_chat):
    f, _ = _methods(tiny_chat)
    plain = f.plain()

    def fixed(prompt_ids, max_new_tokens, temperature, seed, stop_at_eos):
        out = plain.runner(prompt_ids, max_new_tokens, temperature, seed, stop_at_eos)
        return RunResult(out.token_ids, 0.25, None)  # a known wall clock

    methods = [plain, Method("fixed", "plain tokens, 0.25 s", "peer", fixed, draft_depth=0), f.build("ngram:chain@2")]
    prompts = select(load_prompts(None), ["code", "translation", "math"], limit=1)
    raw = run_bench(tiny_chat, prompts, methods, temperatures=[0.0], max_new_tokens=6, progress=False)
    recs = raw["records"]
    units = {}
    for r in recs:
        units.setdefault((r["question_id"], r["turn"]), {})[r["method"]] = r
    assert len(units) == 3
    slots = []
    for unit in units.values():
        orders = sorted(r["order"] for r in unit.values())
        assert orders == list(range(orders[0], orders[0] + 3))  # one contiguous block per prompt: interleaved
        assert unit["plain"]["order"] == orders[0]  # plain first
        slots.append(unit["fixed"]["order"] - orders[0])
        p, fx = unit["plain"], unit["fixed"]
        assert fx["plain_seconds"] == p["seconds"]  # the same prompt's plain timing
        assert fx["speed_up"] == pytest.approx((p["seconds"] / p["new_tokens"]) / (0.25 / fx["new_tokens"]))
        assert fx["wall_ratio"] == pytest.approx(p["seconds"] / 0.25)
        assert p["speed_up"] == pytest.approx(1.0)
    assert len(set(slots)) == 2  # the order of the other methods rotates between prompts
    row = summarize(recs, [m.describe() for m in methods])["T=0"]["overall"]["fixed"]
    import statistics

    assert row["median_speed_up"] == pytest.approx(statistics.median(u["fixed"]["speed_up"] for u in units.values()))


def test_external_peer_is_compared_with_its_own_plain_peer(tiny_chat, tmp_path):
    # llamacpp-lookup is judged against llamacpp's output (not ours), exactly (other weights: no
    # near-tie judgement), and a divergence is shown as "differs", never as our lossless failure
    f, _ = _methods(tiny_chat)
    plain = f.plain()
    calls = []

    def peer_runner(alter):
        def batch(prompts, max_new_tokens, temperature, seeds, stop_at_eos):
            calls.append(alter)
            outs = [plain.runner(p, max_new_tokens, temperature, s, stop_at_eos) for p, s in zip(prompts, seeds)]
            if alter:  # the "lookup" peer changes the last token of every output
                for o in outs:
                    o.token_ids[-1] = (o.token_ids[-1] + 1) % tiny_chat.vocab_size
            return [RunResult(o.token_ids, 0.1, None) for o in outs]
        return batch

    peer = Method("llamacpp", "peer plain", "peer", None, interleaved=False, check="exact", reference="plain",
                  batch_runner=peer_runner(False))
    lookup = Method("llamacpp-lookup@5", "peer lookup", "peer", None, interleaved=False, check="exact",
                    reference="llamacpp", batch_runner=peer_runner(True))
    methods = [plain, peer, lookup]
    prompts = select(load_prompts(None), ["code", "math"], limit=1)
    raw = run_bench(tiny_chat, prompts, methods, temperatures=[0.0], max_new_tokens=6, progress=False)
    assert calls == [False, True]  # one engine call per peer, the reference first
    status = {(r["method"], r["question_id"]): r["check"] for r in raw["records"]}
    for qid in {q for _, q in status}:
        assert status[("llamacpp", qid)]["status"] == "identical"
        lk = status[("llamacpp-lookup@5", qid)]
        assert lk["status"] == "differs" and lk["reference"] == "llamacpp" and lk["first_divergence"] is not None
    rc = write_report(tmp_path, raw, [m.describe() for m in methods], [], {
        "target": "tiny", "dtype": "float64", "temperatures": [0.0], "max_new_tokens": 6, "repeats": 1, "seed": 0,
        "stop_at_eos": True, "datasets": ["builtin"], "limit": 1})
    report = json.loads((tmp_path / "report.json").read_text())
    assert rc == 0 and report["passed"] and validate_report(report) == []
    row = report["summary"]["T=0"]["overall"]["llamacpp-lookup@5"]
    assert row["differs"] == 2 and row["identical"] == 0 and row["failures"] == 0
    assert "2 differ, informational" in (tmp_path / "report.md").read_text()


def test_cli_errors_are_one_line(tiny_dir, tmp_path, capsys):
    base = ["bench", "--target", str(tiny_dir), "--dtype", "float64", "--out", str(tmp_path / "o"), "--no-progress"]
    for extra, msg in [(["--methods", "plain,warp"], "unknown method 'warp'"),
                       (["--peers", "ollama"], "unknown peer 'ollama'"),
                       (["--data", str(tmp_path / "none.jsonl")], "does not exist"),
                       (["--run", str(tmp_path / "runs" / "x")], "does not exist"),
                       (["--categories", "poetry"], "unknown category"),
                       (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1")]:
        assert cli_main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err and msg in err[-1] and err[-1].startswith("specfoundry: error:")


def test_validator_rejects_broken_reports():
    assert validate_report({})  # everything missing
    good_row = {"n": 1, "median_seconds": 1.0, "median_tokens_per_second": 1.0, "median_speed_up": 1.0, "tau": 1.0,
                "acceptance_by_position": [], "drafted": 0, "accepted": 0, "target_forwards": 1, "identical": 0,
                "near_ties": 0, "failures": 0}
    report = {"schema": "specfoundry.bench/1", "created": "x", "passed": True,
              "environment": {"python": "3", "torch": "2", "transformers": "5", "platform": "p", "machine": "m",
                              "cpu_count": 2, "torch_threads": 1, "git_commit": "abc"},
              "settings": {"target": "t", "dtype": "float32", "temperatures": [0.0], "max_new_tokens": 1, "repeats": 1,
                           "seed": 0, "stop_at_eos": True, "datasets": ["builtin"], "limit": None},
              "methods": [{"name": "plain", "label": "p", "kind": "plain", "interleaved": True, "check": "strict"}],
              "unavailable": [], "errors": [], "records": [], "summary": {"T=0": {"overall": {"plain": good_row},
                                                                            "by_category": {}}},
              "failures": [], "files": {}}
    assert validate_report(report) == []
    report["passed"] = False
    assert any("passed" in p for p in validate_report(report))
    report["passed"] = True
    report["summary"]["T=0"]["overall"]["plain"] = {**good_row, "tau": "fast"}
    assert any("tau" in p for p in validate_report(report))


def test_bench_is_packaged_with_its_entry_point_and_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    st = cfg["tool"]["setuptools"]
    assert "specfoundry.bench" in st["packages"] and st["package-dir"]["specfoundry.bench"] == "bench"
    assert "data/*.jsonl" in st["package-data"]["specfoundry.bench"]
    assert cfg["project"]["entry-points"]["specfoundry.commands"]["bench"] == "specfoundry.bench.cli:register"
    assert BUILTIN.is_file() and BUILTIN.parent.parent == ROOT / "bench"
    assert not any(p.is_dir() and any(p.glob("*.py")) and not (p / "__init__.py").exists() for p in (ROOT / "bench").rglob("*"))


def test_merge_pools_parts_split_by_category_and_temperature(tiny_dir, tmp_path, capsys):
    base = ["bench", "--target", str(tiny_dir), "--dtype", "float64", "--limit", "1", "--max-new-tokens", "6",
            "--methods", "plain,ngram:chain", "--peers", "hf", "--no-progress"]
    parts = {"conv0": ["--categories", "conversation", "--temperature", "0"],
             "math0": ["--categories", "math", "--temperature", "0"],
             "math1": ["--categories", "math", "--temperature", "1"]}
    for name, extra in parts.items():
        assert cli_main(base + extra + ["--out", str(tmp_path / name)]) == 0, capsys.readouterr().err
    reps = {n: json.loads((tmp_path / n / "report.json").read_text()) for n in parts}
    out = tmp_path / "merged"
    assert cli_main(["bench", "--merge", *(str(tmp_path / n) for n in parts), "--out", str(out)]) == 0
    merged = json.loads((out / "report.json").read_text())
    assert validate_report(merged) == [] and merged["passed"]
    assert len(merged["records"]) == sum(len(r["records"]) for r in reps.values())
    assert merged["settings"]["temperatures"] == [0.0, 1.0] and merged["settings"]["prompts"] == 3
    # per-category rows are the parts' own rows (the same records); overall pools both categories
    t0 = merged["summary"]["T=0"]
    assert t0["by_category"]["builtin:conversation"] == reps["conv0"]["summary"]["T=0"]["by_category"]["builtin:conversation"]
    assert t0["by_category"]["builtin:math"] == reps["math0"]["summary"]["T=0"]["by_category"]["builtin:math"]
    assert merged["summary"]["T=1"]["overall"] == reps["math1"]["summary"]["T=1"]["overall"]
    assert t0["overall"]["plain"]["n"] == (reps["conv0"]["summary"]["T=0"]["overall"]["plain"]["n"]
                                           + reps["math0"]["summary"]["T=0"]["overall"]["plain"]["n"])
    md = (out / "report.md").read_text()
    assert "Merged from 3 runs" in md and "## T=1: overall" in md and (out / "speedup_by_category.png").is_file()
    capsys.readouterr()
    # refused: a prompt measured twice, other methods, other settings, no --out
    for dirs, extra, msg in [(["conv0", "conv0"], [], "is in both"),
                             (["conv0", "math0"], [], None)]:
        rc = cli_main(["bench", "--merge", *(str(tmp_path / d) for d in dirs), "--out", str(tmp_path / "m2")] + extra)
        err = capsys.readouterr().err
        assert (rc == 2 and msg in err) if msg else rc == 0, err
    assert cli_main(base + ["--categories", "math", "--temperature", "0", "--methods", "plain", "--out",
                            str(tmp_path / "other")]) == 0
    assert cli_main(base + ["--categories", "math", "--temperature", "0", "--max-new-tokens", "5", "--out",
                            str(tmp_path / "short")]) == 0
    capsys.readouterr()
    for other, msg in [("other", "measured other methods"), ("short", "max_new_tokens=5")]:
        assert cli_main(["bench", "--merge", str(tmp_path / "conv0"), str(tmp_path / other), "--out",
                         str(tmp_path / "m3")]) == 2
        assert msg in capsys.readouterr().err
    assert cli_main(["bench", "--merge", str(tmp_path / "conv0"), str(tmp_path / "math0")]) == 2
    assert "needs --out" in capsys.readouterr().err


def test_external_peers_run_after_the_peer_they_are_judged_against(tiny_chat, tmp_path, monkeypatch):
    # --peers order is the user's; a lookup/speculative peer compared with another peer's output
    # must still run after that peer (its reference output must exist when it is checked)
    import specfoundry.bench.external as external
    from specfoundry.bench.cli import build_methods

    monkeypatch.setattr(external, "availability", lambda name, *a, **k: (name != "vllm-eagle3", "no head here"))
    monkeypatch.setattr(external, "external_method", lambda name, depth, *a, **k: Method(
        name, name, "peer", None, interleaved=False, check="exact", reference="plain"))
    f, _ = _methods(tiny_chat)
    methods, unavailable = build_methods(f, tiny_chat, "tiny", "plain,ngram:chain",
                                         "llamacpp-lookup,vllm-eagle3,hf,llamacpp,vllm", tmp_path)
    names = [m.name for m in methods]
    assert names[:3] == ["plain", "ngram:chain@5", "hf"]  # ours, then in-process peers, interleaved
    assert names[3:] == ["llamacpp", "vllm", "llamacpp-lookup"]
    assert unavailable == [{"name": "vllm-eagle3", "reason": "no head here"}]


def test_llamacpp_peer_runs_on_the_benchs_thread_count(tiny_chat, tmp_path, monkeypatch):
    # llama.cpp takes its thread count as an argument (not OMP_NUM_THREADS): the peer ran on one
    # thread whatever --threads said. The request carries ours; the peer script (run for real, on a
    # stub llama_cpp module that records its arguments) passes it for decoding and prompts alike.
    import os
    import subprocess
    import sys

    import specfoundry.bench.external as external

    stub = tmp_path / "stub"
    (stub / "llama_cpp").mkdir(parents=True)
    (stub / "llama_cpp" / "__init__.py").write_text(
        "import json, os\n__version__ = 'stub'\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        "        open(os.environ['STUB_LOG'], 'w').write(json.dumps({k: v for k, v in kw.items() if k != 'draft_model'}))\n"
        "    def token_eos(self): return 2\n"
        "    def reset(self): pass\n"
        "    def set_seed(self, s): pass\n"
        "    def generate(self, ids, **kw):\n"
        "        while True: yield 7\n")
    sent = {}

    def run_engine(python, script, request, work, name, timeout=None):
        sent.update(request)
        req, res = tmp_path / "req.json", tmp_path / "res.json"
        req.write_text(json.dumps(request))
        env = {**os.environ, "PYTHONPATH": str(stub), "STUB_LOG": str(tmp_path / "llama.json")}
        subprocess.run([sys.executable, str(script), str(req), str(res)], env=env, check=True, timeout=120)
        return json.loads(res.read_text())

    monkeypatch.setattr(external, "availability", lambda *a, **k: (True, sys.executable))
    monkeypatch.setattr(external, "gguf_path", lambda source: tmp_path / "model.gguf")
    monkeypatch.setattr(external, "_run_engine", run_engine)
    torch.set_num_threads(2)  # the single_thread fixture puts it back
    method = external.external_method("llamacpp", None, tiny_chat, "tiny", tmp_path)
    runs = method.batch_runner([[1, 2, 3]], 4, 0.0, [0], True)
    assert sent["threads"] == 2 and "2 threads" in method.label
    assert [r.token_ids for r in runs] == [[7, 7, 7, 7]]
    kwargs = json.loads((tmp_path / "llama.json").read_text())
    assert kwargs["n_threads"] == 2 and kwargs["n_threads_batch"] == 2


@pytest.mark.slow
def test_llamacpp_lookup_peer_handles_prompts_past_512_tokens(tmp_path):
    # llama-cpp-python sizes its score buffer from the logits_all argument (512 rows) while a draft
    # model makes it keep every position's logits: long prompts (Spec-Bench summarization) crashed
    from specfoundry.bench.external import gguf_path, project_root

    python = project_root() / ".venv-llamacpp" / "bin" / "python"
    gguf = gguf_path("smollm2-135m")
    if not python.is_file() or gguf is None:
        pytest.skip("needs `make llamacpp-peer` (.venv-llamacpp) and the default model's GGUF")
    req = {"model": str(gguf), "prompts": [[1] + list(range(100, 700))], "max_tokens": 8, "temperature": 0.0,
           "seeds": [0], "ignore_eos": True, "lookup": 5, "max_ngram": 3}
    (tmp_path / "req.json").write_text(json.dumps(req))
    import subprocess

    subprocess.run([str(python), str(project_root() / "bench" / "llamacpp_peer.py"), str(tmp_path / "req.json"),
                    str(tmp_path / "res.json")], check=True, timeout=600)
    res = json.loads((tmp_path / "res.json").read_text())
    assert "error" not in res, res.get("error")
    assert [len(r["token_ids"]) for r in res["results"]] == [8]
