"""Architecture presets: the shapes of known targets and drafts, so a dry run needs no download.

Scope: a frozen :class:`Architecture` (sizes only, no weights), parameter counting for
Llama-style decoders, a table of presets for the models the shipped recipes name, and
:func:`resolve_architecture`, which maps a recipe's ``target.name`` to an ``Architecture``
from a preset, the built-in default's cached directory, or a local HF directory's
``config.json``. Nothing here imports torch or transformers or touches the network.

The preset numbers are the published ``config.json`` values of each model.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["Architecture", "PresetError", "PRESETS", "find_architecture", "resolve_architecture",
           "architecture_from_config", "cache_root"]


class PresetError(ValueError):
    """A target/draft name that is neither a preset nor a local directory with a config.json."""


@dataclass(frozen=True)
class Architecture:
    """Shape of a decoder-only LM (Llama family unless ``gated_mlp`` says otherwise)."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False  # tied: the LM head shares the embedding matrix (no extra params)
    max_position_embeddings: int = 8192
    gated_mlp: bool = True  # SwiGLU (gate, up, down); False: plain 2-matrix MLP (GPT-2 style)
    model_type: str = "llama"

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.hd

    def attention_params(self, input_size: int | None = None) -> int:
        """q, k, v, o projections (no biases). ``input_size`` widens q/k/v inputs (EAGLE-3's 2H)."""
        i = input_size or self.hidden_size
        return i * self.q_dim + 2 * i * self.kv_dim + self.q_dim * self.hidden_size

    def mlp_params(self) -> int:
        n = 3 if self.gated_mlp else 2
        return n * self.hidden_size * self.intermediate_size

    def layer_params(self) -> int:
        """One decoder layer: attention + MLP + two RMSNorm weights."""
        return self.attention_params() + self.mlp_params() + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def param_count(self, num_layers: int | None = None) -> int:
        """Total parameters (embedding + layers + final norm + untied LM head)."""
        n = self.num_layers if num_layers is None else num_layers
        return self.embedding_params() + n * self.layer_params() + self.hidden_size + self.lm_head_params()

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``module name -> (in, out)`` of one layer's linear maps (for LoRA sizing)."""
        H, I = self.hidden_size, self.intermediate_size
        shapes = {"q_proj": (H, self.q_dim), "k_proj": (H, self.kv_dim), "v_proj": (H, self.kv_dim),
                  "o_proj": (self.q_dim, H), "up_proj": (H, I), "down_proj": (I, H)}
        if self.gated_mlp:
            shapes["gate_proj"] = (H, I)
        return shapes

    def to_dict(self) -> dict:
        return asdict(self)


def _llama(name, H, L, heads, kv, I, V, tied, max_pos, head_dim=None) -> Architecture:
    return Architecture(name=name, hidden_size=H, num_layers=L, num_attention_heads=heads,
                        num_key_value_heads=kv, intermediate_size=I, vocab_size=V, head_dim=head_dim,
                        tie_word_embeddings=tied, max_position_embeddings=max_pos)


_SMOLLM2_135M = _llama("HuggingFaceTB/SmolLM2-135M-Instruct", 576, 30, 9, 3, 1536, 49152, True, 8192, 64)
_LLAMA31_8B = _llama("meta-llama/Llama-3.1-8B-Instruct", 4096, 32, 32, 8, 14336, 128256, False, 131072, 128)
_LLAMA33_70B = _llama("meta-llama/Llama-3.3-70B-Instruct", 8192, 80, 64, 8, 28672, 128256, False, 131072, 128)
_LLAMA32_1B = _llama("meta-llama/Llama-3.2-1B-Instruct", 2048, 16, 32, 8, 8192, 128256, True, 131072, 64)

# Keys are lower-cased; base and Instruct variants share a shape, and so do Llama-3.1/3.3 70B.
PRESETS: dict[str, Architecture] = {}
for _arch, _aliases in (
    (_SMOLLM2_135M, ["smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M"]),
    (_LLAMA31_8B, ["llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B",
                   "meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B"]),
    (_LLAMA33_70B, ["llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.1-70B-Instruct",
                    "meta-llama/Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct"]),
    (_LLAMA32_1B, ["llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-1B"]),
):
    for _a in _aliases:
        PRESETS[_a.lower()] = _arch


def architecture_from_config(cfg: dict, name: str = "") -> Architecture:
    """An ``Architecture`` from a HF ``config.json`` dict (Llama-like and GPT-2-like keys)."""
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers nest the LM config
        cfg = cfg["text_config"]

    def get(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is not None:
            return default
        raise PresetError(f"{name or 'config.json'}: none of {list(keys)} in config.json")

    H = int(get("hidden_size", "n_embd", "d_model"))
    heads = int(get("num_attention_heads", "n_head"))
    model_type = str(cfg.get("model_type", "llama"))
    gated = model_type not in {"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon"}
    return Architecture(
        name=name or str(cfg.get("_name_or_path", "")),
        hidden_size=H,
        num_layers=int(get("num_hidden_layers", "n_layer", "num_layers")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads", default=heads)),
        intermediate_size=int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * H)),
        vocab_size=int(get("vocab_size")),
        head_dim=cfg.get("head_dim"),
        # HF's PretrainedConfig defaults tie_word_embeddings to True; Llama's to False
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type != "llama")),
        max_position_embeddings=int(get("max_position_embeddings", "n_positions", default=2048)),
        gated_mlp=gated,
        model_type=model_type,
    )


def cache_root() -> Path:
    """``$SPECFOUNDRY_CACHE`` or ``~/.cache/specfoundry``: the same root as
    ``specfoundry.runtime.models.cache_dir``, read without importing the runtime (torch)."""
    return Path(os.environ.get("SPECFOUNDRY_CACHE", Path.home() / ".cache" / "specfoundry"))


def _builtin_cached_dir(name: str) -> Path | None:
    # the converted directory of a built-in target (runtime/models.py's cache layout), if present
    d = cache_root() / "models" / name
    return d if (d / "config.json").is_file() else None


def find_architecture(name_or_path: str) -> Architecture | None:
    """Preset, then local directory; ``None`` when neither knows the name (never downloads)."""
    key = str(name_or_path).strip()
    p = Path(key).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise PresetError(f"target directory {p} has no config.json")
        return architecture_from_config(json.loads(cfg.read_text()), name=str(p))
    if key.lower() in PRESETS:
        return replace(PRESETS[key.lower()])
    cached = _builtin_cached_dir(key)
    if cached is not None:
        return architecture_from_config(json.loads((cached / "config.json").read_text()), name=key)
    return None


def resolve_architecture(name_or_path: str) -> Architecture:
    """Like :func:`find_architecture` but raises a :class:`PresetError` naming the fixes."""
    arch = find_architecture(name_or_path)
    if arch is None:
        raise PresetError(
            f"no architecture preset for {name_or_path!r} and it is not a local directory; the dry run "
            f"never downloads. Point target.name at a local HF directory (with config.json) or use one of "
            f"the presets: {', '.join(sorted({a.name for a in PRESETS.values()}))}")
    return arch
