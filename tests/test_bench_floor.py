"""The weight-streaming floor's byte count (tied and untied LM heads) and its argument checks."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfoundry.bench.floor import read_bandwidth_gbs, streamed_weight_bytes, weight_streaming_floor


def _llama(tied: bool, dtype=torch.float32):
    cfg = LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).to(dtype)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_bytes_count_every_matrix_once_and_skip_an_untied_embedding(tied, dtype):
    m = _llama(tied, dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    unique = {p.data_ptr(): p.numel() for p in m.parameters()}
    emb = m.get_input_embeddings().weight.numel()
    # tied: the embedding is the LM head, read every step; untied: one embedding row per step
    expected = sum(unique.values()) - (0 if tied else emb)
    assert streamed_weight_bytes(m) == expected * size
    assert (len(unique) < len(list(m.named_parameters(remove_duplicate=False)))) == tied


def test_floor_is_bytes_over_bandwidth():
    m = _llama(True)
    fl = weight_streaming_floor(m, bandwidth_gbs=2.0)
    assert fl["floor_ms"] == pytest.approx(1000 * streamed_weight_bytes(m) / 2e9)
    assert fl["threads"] == torch.get_num_threads()


def test_bandwidth_probe_arguments():
    with pytest.raises(ValueError, match="megabytes and reps"):
        read_bandwidth_gbs(megabytes=0)
    assert read_bandwidth_gbs(megabytes=8, reps=1) > 0


def test_bandwidth_probe_reads_from_the_engines_kind_of_pages(monkeypatch):
    from specfoundry.runtime import hugepages
    taken = []
    real = hugepages.Arena

    class Spy(real):
        def take(self, shape):
            taken.append(shape)
            return super().take(shape)

    monkeypatch.setattr(hugepages, "Arena", Spy)
    monkeypatch.setattr(hugepages, "wanted", lambda: True)
    assert read_bandwidth_gbs(megabytes=4, reps=1) > 0 and taken == [(2**20,)]
    monkeypatch.setattr(hugepages, "wanted", lambda: False)
    assert read_bandwidth_gbs(megabytes=4, reps=1) > 0 and len(taken) == 1
