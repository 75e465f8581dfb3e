"""Targets by Hugging Face Hub id, through the standard HF cache, with no network: the test builds
an offline Hub cache itself (``models--org--name/refs/main`` + ``snapshots/<commit>/``)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.runtime.models import HubError, is_hub_id, load_target

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_model(hub, repo: str, commit: str = COMMIT, safetensors: bool = True):
    root = hub / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(snap)
    if not safetensors:  # an old-style repository: pickled weights only
        for f in snap.glob("*.safetensors"):
            f.unlink()
        torch.save(model.state_dict(), snap / "pytorch_model.bin")
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_hub_id_loads_from_the_offline_cache_and_pins_revisions(offline_hub):
    _cache_model(offline_hub, "tiny-org/tiny-llama")
    t = load_target("tiny-org/tiny-llama")
    assert t.name == "tiny-org/tiny-llama" and t.vocab_size == 32
    assert load_target("tiny-org/tiny-llama", revision=COMMIT).fingerprint() == t.fingerprint()
    with pytest.raises(HubError, match="tiny-org/tiny-llama@v9.*not in the Hugging Face cache"):
        load_target("tiny-org/tiny-llama", revision="v9")


def test_missing_model_offline_is_one_line_naming_the_fix(offline_hub):
    with pytest.raises(HubError) as e:
        load_target("meta-llama/Llama-3.3-70B-Instruct")
    msg = str(e.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE=1" in msg and "hf download meta-llama/Llama-3.3-70B-Instruct" in msg


def test_pickled_weights_are_refused(offline_hub):
    _cache_model(offline_hub, "tiny-org/pickled", safetensors=False)
    with pytest.raises(HubError, match="no safetensors weights"):
        load_target("tiny-org/pickled")


def test_hub_id_shape():
    assert is_hub_id("meta-llama/Llama-3.3-70B-Instruct") and is_hub_id("Qwen/Qwen2.5-0.5B")
    for not_id in ("smollm2-135m", "./a/b", "/abs/path", "a/b/c", "a b/c", "../x"):
        assert not is_hub_id(not_id), not_id
    with pytest.raises(FileNotFoundError, match="neither a built-in target"):
        load_target("no-such-local-dir")
