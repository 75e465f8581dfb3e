"""Training recipes: loading, validating, resolving and dumping.

Scope: reading a recipe (a packaged name or a YAML path) with a strict YAML loader, applying
``--set`` overrides, validating through the schema (:mod:`~specfoundry.train.recipe_schema`)
and turning pydantic's errors into one :class:`RecipeError`, default filling (:func:`resolve`),
``recipe.resolved.yaml`` output, and locating the packaged recipes. The schema models, the
cross-field checks (:mod:`~specfoundry.train.recipe_checks`) and the launcher configs
(:mod:`~specfoundry.train.launcher`) are re-exported here, so ``from specfoundry.train.recipe
import ...`` reaches all of them. It does not build models, read data or launch anything. No
torch import: ``--dry-run`` and the tests stay fast.

Strictness: unknown keys, wrong types, out-of-range values and bad combinations are all
errors, collected and raised together as one :class:`RecipeError` whose message names the
file, the key path (``data.prompts[0].count``) and, for a typo, the closest valid key.
Duplicate YAML keys are errors too (PyYAML would silently keep the last one).
"""

from __future__ import annotations

import copy
import os
import re
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml
from pydantic import BaseModel, ValidationError

from .launcher import (accelerate_config_path, deepspeed_config_for, deepspeed_config_path, launch_args,
                       list_launcher_configs, packaged, process_counts, read_accelerate_config, read_deepspeed_config,
                       zero3_placement_problem, zero_stage)
from .hardware import auto_precision, auto_training_precision
from .presets import PresetError, cache_root, find_architecture
from .recipe_errors import RecipeError, got, suggest
from .recipe_schema import (BUILTIN_HELDOUT, METHODS, PROMPT_SOURCES, SPECULATOR_CLASSES, DataConfig, DraftArchConfig,
                            DraftSpeculator, Eagle3Speculator, EagleSpeculator, EvaluationConfig, FilePrompts,
                            HubPrompts, LauncherConfig, LoraConfig, MagpiePrompts, Medusa2Speculator, MedusaSpeculator,
                            Recipe, ResponsesConfig, TargetConfig, TrackingConfig, TrainingConfig)

__all__ = [
    "RecipeError", "Recipe", "TargetConfig", "Eagle3Speculator", "EagleSpeculator", "MedusaSpeculator",
    "Medusa2Speculator", "DraftSpeculator", "DraftArchConfig", "LoraConfig", "MagpiePrompts", "FilePrompts",
    "HubPrompts", "ResponsesConfig", "DataConfig", "TrainingConfig", "LauncherConfig", "TrackingConfig",
    "EvaluationConfig", "METHODS", "BUILTIN_HELDOUT", "load_recipe", "recipe_from_dict", "resolve", "dump_resolved",
    "list_recipes", "recipe_path", "prompt_source_dicts", "accelerate_config_path", "deepspeed_config_path",
    "list_launcher_configs", "read_accelerate_config", "read_deepspeed_config", "zero_stage", "launch_args",
    "deepspeed_config_for", "default_feature_layers",
]

RESOLVED_FILENAME = "recipe.resolved.yaml"


# --------------------------------------------------------------------------------------------
# YAML
# --------------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads ``1e-4`` as a float (YAML 1.1 wants ``1.0e-4``)."""


_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
_StrictLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
for _ch in list("-+0123456789."):
    _StrictLoader.yaml_implicit_resolvers[_ch] = [
        (t, r) for t, r in _StrictLoader.yaml_implicit_resolvers.get(_ch, []) if t != "tag:yaml.org,2002:float"]
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise _DuplicateKey(None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})",
                                key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise RecipeError(source, [("", f"not valid YAML: {e}")]) from None


# --------------------------------------------------------------------------------------------
# pydantic errors -> RecipeError problems
# --------------------------------------------------------------------------------------------

_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "model_type": "a mapping",
             "model_attributes_type": "a mapping", "dict_type": "a mapping", "speculator_mapping": "a mapping"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _unwrap(tp):
    """The model class or list/union type under Annotated/Optional wrappers."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _walk(loc: tuple) -> tuple[str, type | None, str]:
    """A pydantic error location as ``(key path, model class at it, section words)``: union tags
    (prompt ``source``, speculator ``method``) are dropped from the path and name the section."""
    path, tp, where = "", Recipe, "at the top level"
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(part, int):
            path = f"{path}[{part}]"
            args = typing.get_args(tp)
            tp = args[0] if typing.get_origin(tp) is list and args else None
            where = f"in {path}"
            continue
        if typing.get_origin(tp) is typing.Union:  # a tag
            if part in SPECULATOR_CLASSES and path == "speculator":
                tp, where = SPECULATOR_CLASSES[part], f"in speculator (method {part})"
            else:
                tp, where = PROMPT_SOURCES.get(part), f"in {path} (source {part})"
            continue
        path = f"{path}.{part}" if path else str(part)
        fields = getattr(tp, "model_fields", {}) if isinstance(tp, type) else {}
        tp = fields[part].annotation if part in fields else None
        where = f"in {path}"
    return path, (_unwrap(tp) if tp is not None else None), where


def _choices(expected: str) -> list[str]:
    return re.findall(r"'([^']*)'", expected)


def _num(x):
    return int(x) if isinstance(x, float) and x.is_integer() else x


def _other_method_hint(key: str, method: str) -> str:
    own = set(SPECULATOR_CLASSES[method].model_fields)
    owners = [m for m, c in SPECULATOR_CLASSES.items() if key in c.model_fields]
    if not owners:
        return ""
    return f"; it is an option of {'/'.join(owners)} speculators, not {method} (valid keys: {', '.join(sorted(own))})"


def _problem(err: dict) -> list[tuple[str, str]]:
    kind, loc, value = err["type"], tuple(err["loc"]), err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "recipe_cross_check":
        return list(ctx["problems"])
    if kind == "extra_forbidden":
        parent, cls, where = _walk(loc[:-1])
        key = loc[-1]
        path = f"{parent}.{key}" if parent else str(key)
        if not isinstance(key, str):
            return [(path, f"unknown key {key!r} {where} (keys are strings)")]
        names = list(cls.model_fields) if isinstance(cls, type) and issubclass(cls, BaseModel) else []
        hint = ""
        if where.startswith("in speculator (method "):
            hint = _other_method_hint(key, where[len("in speculator (method "):-1])
        hint = hint or suggest(key, names) or (f" (valid keys: {', '.join(names)})" if names else "")
        return [(path, f"unknown key {key!r} {where}{hint}")]
    path, _, where = _walk(loc)
    if kind == "missing":
        key = loc[-1]
        if path == "method":
            return [(path, f"required key 'method' is missing (one of {', '.join(METHODS)})")]
        return [(path, f"required key {key!r} is missing {_walk(loc[:-1])[2]}")]
    if kind == "literal_error":
        options = _choices(ctx.get("expected", ""))
        return [(path, f"{value!r} is not one of {', '.join(options)}"
                 + (suggest(value, options) if isinstance(value, str) else ""))]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = value.get("source") if isinstance(value, Mapping) else None
        return [(f"{path}.source", f"{tag!r} is not one of {', '.join(PROMPT_SOURCES)}"
                 + (suggest(tag, list(PROMPT_SOURCES)) if isinstance(tag, str) else ""))]
    if kind in _BOUNDS:
        key, sym = _BOUNDS[kind]
        bound = ctx.get(key)
        shown = float(value) if isinstance(bound, float) and isinstance(value, int) else value
        return [(path, f"must be {sym} {_num(bound)}, got {shown}")]
    if kind in _EXPECTED:
        return [(path, f"expected {_EXPECTED[kind]}, got {got(value)}")]
    if kind == "empty_string":
        return [(path, "must not be empty")]
    return [(path, err["msg"])]


def recipe_from_dict(data: Any, source: str = "<dict>", *, name: str | None = None) -> Recipe:
    """Validate a raw mapping (as read from YAML) into a :class:`Recipe`; raises :class:`RecipeError`."""
    if not isinstance(data, Mapping):
        raise RecipeError(source, [("", f"expected a mapping at the top level, got {got(data)}")])
    data = dict(data)
    if not data.get("name"):
        data["name"] = name or (Path(source).stem if source and not source.startswith("<") else "recipe")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(source, [p for err in e.errors() for p in _problem(err)]) from None
    recipe.source = source
    return recipe


# --------------------------------------------------------------------------------------------
# loading, resolving, dumping
# --------------------------------------------------------------------------------------------

def list_recipes() -> list[str]:
    """Names of the packaged recipes (``recipes/<name>.yaml``)."""
    return sorted(p.name[:-5] for p in packaged().iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str | os.PathLike) -> Path:
    """The file a recipe name or path refers to (raises :class:`RecipeError` when there is none)."""
    s = str(name_or_path)
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if "/" in s or os.sep in s or s.endswith((".yaml", ".yml")):
        raise RecipeError(s, [("", "no such recipe file")])
    shipped = Path(str(packaged(s + ".yaml")))
    if shipped.is_file():
        return shipped
    names = list_recipes()
    raise RecipeError(s, [("", f"unknown recipe {s!r}{suggest(s, names)} (packaged: {', '.join(names)}; "
                               "or pass a path to a YAML file)")])


def _apply_overrides(data: dict, overrides: Mapping[str, Any] | Sequence[str], source: str) -> dict:
    """``{"training.max_steps": 10}`` or ``["training.max_steps=10"]`` (values parsed as YAML);
    list items are addressed by index: ``data.prompts.0.count``."""
    items = []
    if isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        for o in overrides:
            if "=" not in o:
                raise RecipeError(source, [("", f"override {o!r} is not KEY=VALUE (e.g. training.max_steps=10)")])
            k, v = o.split("=", 1)
            items.append((k.strip(), _load_yaml(v, source) if v.strip() else None))
    data = copy.deepcopy(data)
    for key, value in items:
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts):
            where = ".".join(parts[:i]) or "the top level"
            if isinstance(node, list):
                if not re.fullmatch(r"-?\d+", part):
                    raise RecipeError(source, [(key, f"override {key!r}: {where} is a list; address its items by "
                                                     f"index (e.g. {where}.0)")])
                idx = int(part)
                if not 0 <= idx < len(node):
                    raise RecipeError(source, [(key, f"override {key!r}: index {idx} is out of range, {where} has "
                                                     f"{len(node)} item(s)")])
                part = idx
            elif not isinstance(node, dict):
                raise RecipeError(source, [(".".join(parts[:i]), f"override {key!r} descends into a {got(node)}")])
            if i == len(parts) - 1:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return data


def load_recipe(name_or_path: str | os.PathLike,
                overrides: Mapping[str, Any] | Sequence[str] | None = None) -> Recipe:
    """Load and validate a recipe: a packaged name (``eagle3-smollm2-135m``) or a YAML path.
    ``overrides`` patch the raw YAML before validation, so their errors read the same way."""
    path = recipe_path(name_or_path)
    source = str(path)
    data = _load_yaml(path.read_text(), source)
    if overrides:
        if not isinstance(data, dict):
            raise RecipeError(source, [("", f"expected a mapping at the top level, got {got(data)}")])
        data = _apply_overrides(data, overrides, source)
    return recipe_from_dict(data, source, name=path.stem)


def prompt_source_dicts(recipe: Recipe) -> list[dict]:
    """``data.prompts`` as plain dicts for ``specfoundry.train.prompts.load_prompts``: the builtin
    topic list is ``topics: None`` there, and a magpie source generates in the responses' dtype."""
    out = []
    for src in recipe.data.prompts:
        d = src.model_dump(mode="python")
        if isinstance(src, MagpiePrompts):
            d["topics"] = None if src.topics == "builtin" else src.topics
            d["dtype"] = recipe.data.responses.dtype or recipe.target.dtype
        out.append(d)
    return out


def default_feature_layers(method: str, num_layers: int) -> list[int] | None:
    """The method's default target feature indices (hidden_states indices, 0..L), as the runtime
    heads define them (``Eagle3Head/EagleHead/MedusaHeads.default_architecture``); ``None`` for
    draft (no features). Restated here because importing the runtime pulls in torch and
    transformers, which the dry run must not; ``tests/test_tidy_recipes.py`` pins the two equal."""
    L = int(num_layers)
    if method == "eagle3":
        return [min(max(i, 0), L) for i in (2, L // 2, L - 3)]
    if method in ("eagle", "medusa1", "medusa2"):
        return [L]
    return None


def resolve(recipe: Recipe) -> Recipe:
    """A copy with every default filled that can be filled without a download: output_dir,
    cache_dir, response dtype, precision `auto`, ttt_steps, W&B mode/run name, launcher process counts, draft
    config sizes, and feature layers (when the target's architecture is a preset or local).
    Idempotent. ``speculator.choices: null`` stays null: it names the runtime's default tree."""
    r = copy.deepcopy(recipe)
    r.output_dir = r.output_dir or f"runs/{r.name}"
    r.data.cache_dir = r.data.cache_dir or str(cache_root() / "data" / r.name)
    if r.method == "eagle3" and r.training.ttt_steps is None:
        r.training.ttt_steps = 3
    if r.tracking.wandb_mode == "auto":
        r.tracking.wandb_mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    r.tracking.run_name = r.tracking.run_name or r.name
    acc = read_accelerate_config(r.launcher.config)
    r.launcher.num_processes, r.launcher.num_machines = process_counts(r)
    if r.target.placement == "auto":
        # partitioned where ZeRO-3 runs over several processes and the recipe allows it (see
        # launcher.zero3_placement_problem: offline features, Medusa-2, drafts from target layers)
        r.target.placement = "zero3" if zero_stage(r) == 3 and r.launcher.num_processes > 1 \
            and zero3_placement_problem(r) is None else "replicate"
    if r.target.device == "auto":
        r.target.device = "cpu" if acc.get("use_cpu") else "cuda"
    # precision "auto": what this machine multiplies fastest in batches (train/hardware.py)
    best = auto_precision(r.target.device.split(":")[0])
    if r.target.dtype == "auto":
        r.target.dtype = best
    r.data.responses.dtype = r.data.responses.dtype or r.target.dtype
    if r.data.responses.dtype == "auto":
        r.data.responses.dtype = best
    if r.training.precision == "auto":
        r.training.precision = auto_training_precision(r.target.device.split(":")[0])
    if r.method != "draft" and r.target.feature_layers is None:
        try:
            arch = find_architecture(r.target.name)
        except PresetError:
            arch = None
        if arch is not None:
            r.target.feature_layers = default_feature_layers(r.method, arch.num_layers)
    c = getattr(r.speculator, "config", None)
    if isinstance(c, DraftArchConfig):
        c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
        c.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        c.intermediate_size = c.intermediate_size or -(-(8 * c.hidden_size // 3) // 64) * 64
    return r


class _Dumper(yaml.SafeDumper):
    pass


def _repr_list(dumper, data):
    # short scalar lists inline ([2, 15, 27]) keep the resolved file readable
    flow = all(isinstance(x, (int, float, str)) for x in data) and len(data) <= 16
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _repr_list)


def dump_resolved(recipe: Recipe, path: str | os.PathLike) -> Path:
    """Write the resolved recipe (all defaults filled) as YAML. ``path`` is a directory (the
    file is ``recipe.resolved.yaml`` inside it) or a file path. Returns the file written; loading
    it gives back ``resolve(recipe)``."""
    out = Path(path)
    if out.is_dir() or not out.suffix:
        out.mkdir(parents=True, exist_ok=True)
        out = out / RESOLVED_FILENAME
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    resolved = resolve(recipe)
    header = (f"# resolved recipe {resolved.name} (from {recipe.source or 'a dict'}); every default filled.\n"
              f"# rerun: specfoundry train {out}\n")
    body = yaml.dump(resolved.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    out.write_text(header + body)
    return out
