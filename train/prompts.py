"""Prompt sources for self-distillation: synthesized by the target, local files, datasets hub.

Scope:

- :func:`magpie_prompts` (the default, zero external data): the target writes user prompts
  itself, Magpie-style (Xu et al. 2024) — it is fed the chat template's user-turn prefix and
  samples until the end of the user turn. Most candidates are seeded with a task-type opener
  and a topic from :mod:`.topics` for diversity; the rest are free. Generation is batched and
  cached in rounds (resumable like self-distillation), then filtered and deduplicated.
- :func:`extract_prompt` / :func:`read_prompt_file`: the first user turn of local JSON/JSONL
  records — ShareGPT ``conversations``, OpenAI ``messages``, Spec-Bench/MT-bench ``turns``,
  ``prompt``, ``instruction`` (+ ``input``), ``question``.
- :func:`load_hub_prompts`: the same extraction over ``datasets.load_dataset(...)``.
- :func:`load_prompts`: a list of source dicts -> one deduplicated prompt list.
"""

from __future__ import annotations

import glob
import json
import math
import random
import re
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from specfoundry.runtime.logs import stderr_logger

from . import generation as _generation
from . import topics as _topics
from .datacache import ChunkReport, GenStats, cached_chunks, dtype_name, model_fingerprint, resolve_dtype, stable_hash
from .generation import ChatFormat, generation_model


_log = stderr_logger(__name__)


# ---------------------------------------------------------------------------------------------
# record formats
# ---------------------------------------------------------------------------------------------

_HUMAN = {"human", "user"}


def _turn_text(turn) -> tuple[str | None, str]:
    """(role, text) of one ShareGPT/OpenAI-style turn."""
    if not isinstance(turn, dict):
        return None, ""
    role = turn.get("from", turn.get("role"))
    text = turn.get("value", turn.get("content"))
    if isinstance(text, list):  # OpenAI multi-part content: keep the text parts
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    return (str(role).lower() if role is not None else None), (text if isinstance(text, str) else "")


def extract_prompt(record) -> str | None:
    """The first user turn of one record, or None when the record has no usable one.

    - ``conversations`` (ShareGPT): the first turn must be from ``human``/``user`` and non-empty
      (a conversation that starts with the assistant or a system turn is skipped, as the data
      README asks);
    - ``messages`` (OpenAI chat): leading ``system`` messages are skipped, then it must be ``user``;
    - ``turns`` (Spec-Bench / MT-bench): the first turn;
    - ``prompt``: a string (or a list of chat messages, handled like ``messages``);
    - ``instruction`` with an optional ``input`` (or ``instances[0].input``, self-instruct);
    - ``question``.
    """
    if isinstance(record, str):
        return record.strip() or None
    if not isinstance(record, dict):
        return None
    if "conversations" in record:
        conv = record["conversations"]
        if not isinstance(conv, list) or not conv:
            return None
        role, text = _turn_text(conv[0])
        return text.strip() if role in _HUMAN and text.strip() else None
    if "messages" in record or isinstance(record.get("prompt"), list):
        msgs = record.get("messages", record.get("prompt"))
        if not isinstance(msgs, list):
            return None
        for m in msgs:
            role, text = _turn_text(m)
            if role == "system":
                continue
            return text.strip() if role in _HUMAN and text.strip() else None
        return None
    if "turns" in record:
        turns = record["turns"]
        first = turns[0] if isinstance(turns, list) and turns else None
        if isinstance(first, dict):
            first = _turn_text(first)[1]
        return first.strip() if isinstance(first, str) and first.strip() else None
    for key in ("prompt", "instruction", "question"):
        val = record.get(key)
        if isinstance(val, str) and val.strip():
            if key != "instruction":
                return val.strip()
            extra = record.get("input")
            if extra is None and isinstance(record.get("instances"), list) and record["instances"]:
                inst = record["instances"][0]
                extra = inst.get("input") if isinstance(inst, dict) else None
            extra = extra.strip() if isinstance(extra, str) else ""
            return f"{val.strip()}\n\n{extra}" if extra else val.strip()
    return None


def iter_records(path: str | Path) -> Iterator[dict]:
    """Records of one JSON (a list, or a dict holding one) or JSONL file.

    JSONL is split on ``\\n`` only: ``str.splitlines`` also splits on U+2028, which occurs inside
    strings in some prompt files."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or (stripped and stripped[0] == "{" and "\n{" in stripped and path.suffix != ".json"):
        for n, line in enumerate(text.split("\n"), 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        return
    data = json.loads(text)
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: a JSON object must hold exactly one list of records")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of records")
    yield from data


def _expand_paths(path: str | Path) -> list[Path]:
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(q for q in p.iterdir() if q.suffix in (".json", ".jsonl"))
    elif any(c in str(path) for c in "*?["):
        files = sorted(Path(q) for q in glob.glob(str(p)))
    else:
        files = [p]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no prompt file at {path}")
    return files


def _take(prompts: Iterable[str], limit: int | None, shuffle: bool, seed: int) -> list[str]:
    prompts = list(prompts)
    if shuffle:
        random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit is not None else prompts


def read_prompt_file(path: str | Path, limit: int | None = None, *, shuffle: bool = False, seed: int = 0) -> list[str]:
    """First user turns from a JSON/JSONL file, a directory of them or a glob, in file order
    (``shuffle`` samples ``limit`` of them at random instead of taking the first)."""
    out: list[str] = []
    skipped = 0
    for f in _expand_paths(path):
        for rec in iter_records(f):
            p = extract_prompt(rec)
            if p is None:
                skipped += 1
            else:
                out.append(p)
    if skipped:
        _log(f"{path}: skipped {skipped} records without a usable first user turn")
    return _take(out, limit, shuffle, seed)


def load_hub_prompts(name: str, split: str = "train", limit: int | None = None, *, subset: str | None = None,
                     shuffle: bool = False, seed: int = 0, **load_kwargs) -> list[str]:
    """First user turns from ``datasets.load_dataset(name, subset, split=split, **load_kwargs)``
    (a hub name, a cached one, or a builder such as ``"json"`` with ``data_files``)."""
    from datasets import load_dataset

    ds = load_dataset(name, subset, split=split, **load_kwargs)
    out: list[str] = []
    for rec in ds:
        p = extract_prompt(rec)
        if p is not None:
            out.append(p)
            if limit is not None and not shuffle and len(out) >= limit:
                break  # first `limit` usable records: no need to scan a large set
    return _take(out, limit, shuffle, seed)


# ---------------------------------------------------------------------------------------------
# filtering and deduplication
# ---------------------------------------------------------------------------------------------


def normalize_for_dedup(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip().rstrip(".?!:;, ")


def prompt_problem(text: str, *, min_chars: int = 10, max_chars: int = 4000) -> str | None:
    """Why a synthesized prompt should be dropped (None when it looks like a real request).

    Cheap language-ish checks for a small model's samples: length, leaked template markup,
    mostly non-ASCII or non-letter text (number dumps, mojibake), and degenerate repetition."""
    t = text.strip()
    if len(t) < min_chars:
        return "too short"
    if len(t) > max_chars:
        return "too long"
    if "<|" in t or "|>" in t or "\ufffd" in t:
        return "template markup or broken bytes"
    chars = [c for c in t if not c.isspace()]
    if sum(c.isascii() for c in chars) < 0.85 * len(chars):
        return "mostly non-ASCII"
    if sum(c.isalpha() for c in chars) < 0.5 * len(chars):
        return "mostly symbols or numbers"
    words = t.split()
    if len(words) < 3:
        return "too few words"
    if len(words) >= 12 and len({w.lower() for w in words}) < 0.35 * len(words):
        return "repetitive"
    lines = [ln.strip() for ln in t.split("\n") if len(ln.strip()) > 10]
    if lines and max(lines.count(ln) for ln in lines) >= 3:
        return "repeated lines"
    return None


def dedup(prompts: Iterable[str], seen: set[str] | None = None) -> list[str]:
    """Drop repeats (after lower-casing and collapsing whitespace), keeping the first."""
    seen = set() if seen is None else seen
    out = []
    for p in prompts:
        k = normalize_for_dedup(p)
        if k and k not in seen:
            seen.add(k)
            out.append(p)
    return out


# ---------------------------------------------------------------------------------------------
# Magpie
# ---------------------------------------------------------------------------------------------

MAGPIE_DEFAULTS = {
    "count": 256, "topics": None, "task_types": None, "seed": 0, "max_prompt_tokens": 96, "min_new_tokens": 2,
    "temperature": 1.0, "top_p": 0.95, "top_k": 0, "batch_size": 48, "dtype": None, "free_fraction": 0.25,
    "system_hints": False, "round_size": 192, "max_rounds": None, "require_finished": True, "filter": True,
}


def _load_topics(topics) -> list[str]:
    if topics is None:
        return _topics.all_topics()
    if isinstance(topics, (str, Path)):
        lines = Path(topics).read_text(encoding="utf-8").split("\n")
        return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [str(t) for t in topics]


def magpie_specs(n: int, rng: random.Random, *, topics: list[str], task_types: list[str] | None,
                 free_fraction: float, system_hints: bool) -> list[dict]:
    """``n`` candidate seeds: ``{"system": str | None, "opener": str}`` (empty opener = free)."""
    tasks = task_types or sorted(_topics.TASK_OPENERS)
    unknown = set(tasks) - set(_topics.TASK_OPENERS)
    if unknown:
        raise ValueError(f"unknown task types {sorted(unknown)}; known: {sorted(_topics.TASK_OPENERS)}")
    specs = []
    for _ in range(n):
        topic = rng.choice(topics)
        if rng.random() < free_fraction:
            system = (f"You are a helpful AI assistant. The user's message is about {topic}."
                      if system_hints else None)
            specs.append({"system": system, "opener": ""})
            continue
        task = rng.choice(tasks)
        opener = rng.choice(_topics.TASK_OPENERS[task]).format(
            topic=topic, code_topic=rng.choice(_topics.CODE_TOPICS), lang=rng.choice(_topics.PROGRAMMING_LANGUAGES),
            human_lang=rng.choice(_topics.HUMAN_LANGUAGES))
        system = (f"You are a helpful AI assistant. The user asks a {task} question about {topic}."
                  if system_hints else None)
        specs.append({"system": system, "opener": opener})
    return specs


def magpie_prompts(target, count: int = 256, *, cache_dir: str | Path | None = None, deadline: float | None = None,
                   guard: ChunkReport | None = None, **cfg) -> list[str]:
    """``count`` distinct user prompts written by ``target`` itself (fewer only if ``max_rounds``
    runs out). Options (see ``MAGPIE_DEFAULTS``): ``topics`` (list, or a text file with one per
    line), ``task_types``, ``seed``, ``max_prompt_tokens`` (longer samples are cut and, with
    ``require_finished``, dropped), ``temperature``/``top_p``/``top_k``, ``batch_size``, ``dtype``,
    ``free_fraction`` (share of unseeded candidates), ``system_hints`` (also name the topic in
    the system message), ``round_size`` (candidates per cached round), ``filter``. Past
    ``deadline`` (``time.time()``) no new round starts (cached rounds are still read); then
    ``guard.skipped`` (when given) counts one more stage cut short by its time budget."""
    cfg = {**MAGPIE_DEFAULTS, **cfg, "count": count}
    unknown = set(cfg) - set(MAGPIE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown magpie options {sorted(unknown)}; known: {sorted(MAGPIE_DEFAULTS)}")
    chat = ChatFormat(target)
    gen_dtype = resolve_dtype(cfg["dtype"]) or target.dtype
    model = generation_model(target, gen_dtype)
    topic_list = _load_topics(cfg["topics"])
    stop = chat.user_stop_ids
    # everything that changes a round's output is in the key; `count` is not, so asking for more
    # prompts later reuses the rounds already generated
    key_base = {"kind": "magpie-v2", "target": model_fingerprint(target), "template": chat.template_id(),
                "dtype": dtype_name(gen_dtype),
                **{k: cfg[k] for k in ("max_prompt_tokens", "min_new_tokens", "temperature", "top_p", "top_k",
                                       "batch_size")}}
    report = ChunkReport()
    stats: GenStats = report.stats

    def compute(specs: list[dict], chunk_seed: int) -> dict[str, list]:
        prefixes = [chat.user_prefix_ids(s["system"]) + (chat.encode_text(s["opener"]) if s["opener"] else [])
                    for s in specs]
        n_pre = [len(chat.user_prefix_ids(s["system"])) for s in specs]
        # looked up on the module at call time, so tests can count or interrupt the calls
        new, fin = _generation.generate_batched(
            model, prefixes, max_new_tokens=cfg["max_prompt_tokens"], temperature=cfg["temperature"],
            top_p=cfg["top_p"], top_k=cfg["top_k"], stop_ids=stop, min_new_tokens=cfg["min_new_tokens"],
            batch_size=cfg["batch_size"], pad_id=chat.pad_id, seed=chunk_seed, progress="magpie prompts", stats=stats)
        texts = []
        for pre, k, ids, done in zip(prefixes, n_pre, new, fin):
            body = pre[k:] + (ids[:-1] if done else ids)  # opener + continuation, without the stop token
            texts.append(chat.decode(body).strip())
        return {"text": texts, "finished": fin, "system": [s["system"] or "" for s in specs],
                "opener": [s["opener"] for s in specs]}

    tmp = None
    if cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specfoundry-magpie-")
        root = Path(tmp.name)
    else:
        root = Path(cache_dir) / "magpie" / stable_hash(key_base)[:16]
    try:
        out: list[str] = []
        seen: set[str] = set()
        reasons: dict[str, int] = {}
        max_rounds = cfg["max_rounds"] or max(4, 4 * math.ceil(count / cfg["round_size"]))
        rnd = 0
        out_of_time = False
        while len(out) < count and rnd < max_rounds:
            rng = random.Random(f"{cfg['seed']}-{rnd}")
            specs = magpie_specs(cfg["round_size"], rng, topics=topic_list, task_types=cfg["task_types"],
                                 free_fraction=cfg["free_fraction"], system_hints=cfg["system_hints"])
            for s in specs:
                s["round"] = rnd  # identical seeds in different rounds must still sample differently
            ds = cached_chunks(root, specs, len(specs), key_base, compute, desc="magpie", report=report,
                               deadline=deadline)
            if ds is None:  # out of time
                out_of_time = True
                break
            for text, done in zip(ds["text"], ds["finished"]):
                why = None
                if not text:
                    why = "empty"
                elif cfg["require_finished"] and not done:
                    why = f"longer than {cfg['max_prompt_tokens']} tokens"
                elif cfg["filter"] and chat.has_template:
                    why = prompt_problem(text)
                if why is None and normalize_for_dedup(text) in seen:
                    why = "duplicate"
                if why is not None:
                    reasons[why] = reasons.get(why, 0) + 1
                    continue
                seen.add(normalize_for_dedup(text))
                out.append(text)
                if len(out) >= count:
                    break
            rnd += 1
    finally:
        if tmp is not None:
            tmp.cleanup()
    kept = f"{len(out)} prompts from {rnd} round(s) of {cfg['round_size']}"
    dropped = ", ".join(f"{v} {k}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    _log(f"magpie: {kept}; dropped: {dropped or 'none'}; rounds generated {report.computed}, reused {report.reused}")
    if stats.seconds:
        _log(f"magpie generation ({dtype_name(gen_dtype)}, batch {cfg['batch_size']}): {stats.summary()}")
    if len(out) < count:
        if out_of_time and guard is not None:
            guard.skipped += 1
        why = "the data time budget ran out (data.max_minutes)" if out_of_time else "raise max_rounds or loosen filters"
        _log(f"magpie: only {len(out)} of {count} prompts after {rnd} rounds ({why})")
    return out


# ---------------------------------------------------------------------------------------------
# source dicts
# ---------------------------------------------------------------------------------------------


def load_source(spec: dict, *, target=None, cache_dir: str | Path | None = None, seed: int = 0,
                deadline: float | None = None, guard: ChunkReport | None = None) -> list[str]:
    """Prompts of one source dict: ``{"source": "magpie", "count": N, ...}``,
    ``{"source": "file", "path": ..., "limit": N, "shuffle": bool}`` or
    ``{"source": "hub", "name": ..., "split": "train", "subset": None, "limit": N, ...}`` (other
    keys of a hub source go to ``datasets.load_dataset``)."""
    spec = dict(spec)
    kind = spec.pop("source", None)
    if kind == "magpie":
        if target is None:
            raise ValueError("a magpie prompt source needs the target")
        spec.setdefault("seed", seed)
        return magpie_prompts(target, spec.pop("count", MAGPIE_DEFAULTS["count"]), cache_dir=cache_dir,
                              deadline=deadline, guard=guard, **spec)
    if kind == "file":
        return read_prompt_file(spec.pop("path"), spec.pop("limit", None), shuffle=spec.pop("shuffle", False),
                                seed=spec.pop("seed", seed), **_no_extra(spec, "file"))
    if kind == "hub":
        name = spec.pop("name")
        return load_hub_prompts(name, spec.pop("split", "train"), spec.pop("limit", None),
                                subset=spec.pop("subset", None), shuffle=spec.pop("shuffle", False),
                                seed=spec.pop("seed", seed), **spec)
    raise ValueError(f"unknown prompt source {kind!r} (use 'magpie', 'file' or 'hub')")


def _no_extra(spec: dict, kind: str) -> dict:
    if spec:
        raise ValueError(f"unknown keys for a {kind} source: {sorted(spec)}")
    return {}


def load_prompts(sources: list[dict], *, target=None, cache_dir: str | Path | None = None, seed: int = 0,
                 deadline: float | None = None, guard: ChunkReport | None = None) -> list[str]:
    """All sources' prompts in order, deduplicated across sources (``deadline``, ``guard``: see
    :func:`magpie_prompts`)."""
    seen: set[str] = set()
    out: list[str] = []
    for spec in sources:
        got = load_source(spec, target=target, cache_dir=cache_dir, seed=seed, deadline=deadline, guard=guard)
        new = dedup(got, seen)
        label = " ".join(str(x) for x in (spec.get("source"), spec.get("path") or spec.get("name")) if x)
        _log(f"{label}: {len(got)} prompts, {len(new)} new after dedup")
        out.extend(new)
    return out
