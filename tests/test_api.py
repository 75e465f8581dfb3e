"""The public API and CLI: loading targets and drafters, streaming, stats, clear errors."""

import json

import pytest
import torch

from tiny_models import tiny_llama
from specfoundry.runtime import SpeculativeGenerator, available_drafters, load_drafter, load_target
from specfoundry.runtime.cli import main as cli_main
from specfoundry.runtime.drafters.draft import DraftModelDrafter, layer_subset_model
from specfoundry.runtime.models import builtin_model_dir


def test_builtin_target_is_a_cached_safetensors_llama(smollm2):
    d = builtin_model_dir("smollm2-135m")
    assert (d / "model.safetensors").exists() and (d / "tokenizer.json").exists()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    assert smollm2.num_layers == 30 and smollm2.vocab_size == 49152 and smollm2.tokenizer is not None


def test_load_target_from_local_directory(tmp_path):
    tiny = tiny_llama(0, dtype=torch.float32)
    tiny.model.save_pretrained(tmp_path / "tiny")
    loaded = load_target(str(tmp_path / "tiny"))
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded.model(ids).logits, tiny.model(ids).logits)
    assert loaded.fingerprint() == tiny.fingerprint()


def test_load_target_unknown_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in target"):
        load_target(str(tmp_path / "nope"))


def test_load_drafter_unknown_is_a_clear_error(tiny_target):
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        load_drafter("nope", target=tiny_target)
    assert {"ngram", "draft", "medusa", "eagle", "eagle3"} <= set(available_drafters())


def test_draft_model_with_other_vocabulary_is_refused(tiny_target):
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        DraftModelDrafter(tiny_llama(1, vocab=32), tiny_target)


def test_stream_yields_what_generate_returns(smollm2):
    gen = SpeculativeGenerator(smollm2, load_drafter("ngram", target=smollm2))
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    out = gen.generate(msgs, max_new_tokens=24)
    chunks = list(gen.stream(msgs, max_new_tokens=24))
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert "".join(c.text for c in chunks) == out.text
    s = chunks[-1].stats  # (adaptive depth choices depend on timing, so compare within one run)
    assert s.target_forwards == len(chunks) and s.new_tokens == len(out.token_ids)
    assert s.tau == pytest.approx(s.new_tokens / s.target_forwards)
    assert s.seconds > 0 and s.accepted <= s.drafted
    assert set(s.as_dict()) >= {"tau", "acceptance_by_position", "target_forwards", "drafted", "accepted", "seconds"}


def test_bad_generate_arguments(tiny_target):
    gen = SpeculativeGenerator(tiny_target)
    with pytest.raises(ValueError, match="exactly one of"):
        gen.generate(prompt_ids=[1], prompt="x")
    with pytest.raises(ValueError, match="temperature"):
        gen.generate(prompt_ids=[1], temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        gen.generate(prompt_ids=[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate(prompt_ids=[1], temperature=1.0, top_p=1.5)


def test_layer_subset_draft_keeps_chosen_layers(tiny_target):
    sub = layer_subset_model(tiny_target, [0, 3])
    assert sub.num_layers == 2
    torch.testing.assert_close(sub.model.model.layers[1].mlp.up_proj.weight, tiny_target.model.model.layers[3].mlp.up_proj.weight)
    torch.testing.assert_close(sub.lm_head.weight, tiny_target.lm_head.weight)
    with pytest.raises(ValueError, match="subset"):
        layer_subset_model(tiny_target, [4])


def test_cli_generate_compare_json(smollm2, capsys):
    code = cli_main(["generate", "--drafter", "ngram", "--dtype", "float32", "--prompt", "Say hello three times.",
                     "--max-new-tokens", "16", "--compare", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["identical"] is True and len(out["token_ids"]) <= 16
    assert out["stats"]["tau"] >= 1.0 and out["wall_clock_ratio"] > 0
    assert out["plain_stats"]["drafted"] == 0


def test_cli_generate_readable(smollm2, capsys):
    code = cli_main(["generate", "--drafter", "eagle3", "--prompt", "Name a color.", "--max-new-tokens", "8",
                     "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"])
    captured = capsys.readouterr()
    assert code == 0 and "speculative:" in captured.err and "tau" in captured.err


def test_cli_bad_drafter_is_one_clear_line(smollm2, capsys):
    code = cli_main(["generate", "--drafter", "no-such", "--prompt", "x"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("specfoundry: error: unknown drafter") and "Traceback" not in err


def test_incremental_detokenizer_equals_whole_decode_and_holds_split_characters(smollm2):
    """Streaming decodes a window per step, never the whole output; its deltas add up to the
    whole decode, and a character split over byte tokens is held back until it is complete."""
    from specfoundry.runtime.generator import IncrementalDetokenizer

    text = "Caches 🦀 are fast — naïve KV copies are O(n²). 日本語のテキスト! def f(x):\n    return x"
    ids = smollm2.tokenizer(text)["input_ids"]
    calls = []

    def decode(chunk):
        calls.append(len(chunk))
        return smollm2.decode(chunk)

    detok = IncrementalDetokenizer(decode)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == smollm2.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    crab = smollm2.tokenizer("🦀")["input_ids"]
    assert len(crab) == 3, "the test needs a character spread over several byte tokens"
    held = IncrementalDetokenizer(smollm2.decode)
    assert [held.push([i]) for i in crab] == ["", "", "🦀"]
    assert max(calls) < 12, "each step decodes a short window"
