"""Parity of exported graphs with the PyTorch runtime, and :func:`export_all`.

Scope: figures for the export report, no pass/fail policy (tests set tolerances):

- :func:`parity_report`: onnxruntime (CPU) vs PyTorch max abs differences for the target
  (logits, hidden states, present KV) and the speculator (EAGLE step: hidden, logits, KV; EAGLE
  fusion; Medusa logits) at several dynamic shapes (tree sizes x past lengths, random trees).
- :func:`greedy_end_to_end`: the runtime's ``SpeculativeGenerator`` driven by onnxruntime
  sessions for target and speculator (:mod:`.ort`) vs the same generator on the PyTorch modules
  and vs plain PyTorch greedy decoding. A divergence is reported with the top-2 logit gap of
  the PyTorch target at that position, flagged ``near_tie`` below ``1e-4`` (fp32 rounding
  between a batched tree pass and a sequential pass can flip such argmaxes); it is never hidden.
- :func:`export_all`: both graphs in both variants plus all of the above, as one report entry.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from specfoundry.runtime.drafters.eagle import EagleDrafter
from specfoundry.runtime.drafters.medusa import MedusaDrafter
from specfoundry.runtime.generator import SpeculativeGenerator
from specfoundry.runtime.speculators import Eagle3Head, EagleHead, MedusaHeads
from specfoundry.runtime.target import KVCache, TargetModel
from specfoundry.runtime.tree import ancestor_matrix, tree_depths

from .graphs import VARIANTS, export_onnx, fuse_path
from .ort import OrtEagleHead, OrtMedusaHeads, OrtTarget, load_ort_drafter, make_session, _mask_feed, _np

__all__ = ["NEAR_TIE", "graph_paths", "parity_report", "compare_greedy", "greedy_end_to_end", "export_all"]

NEAR_TIE = 1e-4


def graph_paths(out_dir, variant: str) -> dict[str, Path]:
    """The file names the export writes (and the TensorRT engine builder reads) for ``variant``."""
    d = Path(out_dir)
    spec = d / f"speculator.{variant}.onnx"
    return {"target": d / f"target.{variant}.onnx", "speculator": spec, "speculator_fuse": fuse_path(spec)}


def _random_tree(T: int, B: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, T]`` parents of a random tree per row (node 0 the root)."""
    parents = torch.full((B, T), -1, dtype=torch.long)
    for i in range(1, T):
        parents[:, i] = (torch.rand(B, generator=gen) * i).long()
    return parents


def _diff(a, b) -> float:
    a = a.detach().cpu().double() if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a)).double()
    b = b.detach().cpu().double() if isinstance(b, torch.Tensor) else torch.from_numpy(np.asarray(b)).double()
    if a.shape != b.shape:
        raise AssertionError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _scale(a) -> float:
    a = a.detach().cpu().double() if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a)).double()
    return float(a.abs().max()) if a.numel() else 0.0


def _summarise(rows: list[dict], keys: tuple[str, ...]) -> dict:
    return {k: max(r[k] for r in rows) for k in keys}


# --------------------------------------------------------------------------- target parity


@torch.inference_mode()
def _target_parity(target: TargetModel, path, feature_layers, shapes, batch: int, seed: int, threads) -> dict:
    sess = make_session(path, threads)
    ort_target = OrtTarget(path, threads=threads)
    meta = ort_target.meta
    missing = [i for i in feature_layers if i not in meta["feature_layers"]]
    if missing:
        raise ValueError(f"{path} does not output feature layers {missing} the speculator needs")
    feature_layers = tuple(meta["feature_layers"])  # compare everything the graph outputs
    outs = [o.name for o in sess.get_outputs()]
    gen = torch.Generator().manual_seed(seed)
    V, L = target.vocab_size, target.num_layers
    rows = []
    for T, P in shapes:
        prefix = torch.randint(0, V, (batch, P), generator=gen)
        ids = torch.randint(0, V, (batch, T), generator=gen)
        parents = _random_tree(T, batch, gen)
        mask, pos = ancestor_matrix(parents), P + tree_depths(parents)
        cache = KVCache()  # the reference runs the HF path, whose modules the graph was exported from
        if P:
            target.forward(prefix, cache)
            cache.commit()
        past = [(cache.hf.layers[i].keys, cache.hf.layers[i].values) for i in range(L)] if P else None
        ref = target.forward(ids, cache, position_ids=pos, tree_mask=mask, feature_layers=tuple(feature_layers))
        feeds = {"input_ids": _np(ids), "position_ids": _np(pos), "tree_mask": _mask_feed(meta, mask)}
        for i in range(L):
            for j, kv in enumerate(("key", "value")):
                feeds[f"past_key_values.{i}.{kv}"] = (_np(past[i][j]) if past else
                                                      np.zeros((batch, meta["num_kv_heads"], 0, meta["head_dim"]), np.float32))
        got = dict(zip(outs, sess.run(None, feeds)))
        kv_d = max(_diff(got[f"present.{i}.{kv}"], getattr(cache.hf.layers[i], kv + "s"))
                   for i in range(L) for kv in ("key", "value"))
        row = {"tree_size": T, "past_len": P, "logits": _diff(got["logits"], ref.logits), "kv": kv_d,
               "logits_scale": _scale(ref.logits)}
        if feature_layers:
            row["hidden_states"] = _diff(got["hidden_states"], ref.features)
            row["hidden_scale"] = _scale(ref.features)
        # the OrtTarget wrapper (what the generator drives) must give the same numbers as the raw session
        c2 = KVCache()
        if P:
            ort_target.forward(prefix, c2)
            c2.commit()
        w = ort_target.forward(ids, c2, position_ids=pos, tree_mask=mask, feature_layers=tuple(feature_layers))
        row["wrapper_logits"] = _diff(w.logits, ref.logits)
        rows.append(row)
    keys = ("logits", "kv", "wrapper_logits") + (("hidden_states",) if feature_layers else ())
    return {"max": _summarise(rows, keys), "shapes": rows}


# --------------------------------------------------------------------------- speculator parity


@torch.inference_mode()
def _eagle_parity(head, target: TargetModel, path, shapes, batch: int, seed: int, threads) -> dict:
    ort_head = OrtEagleHead(path, threads=threads)
    gen = torch.Generator().manual_seed(seed)
    V = target.vocab_size
    rows = []
    for T, P in shapes:
        # realistic inputs: fused features of real target hidden states
        seq = torch.randint(0, V, (batch, P + T), generator=gen)
        feats = target.forward(seq, target.new_cache(), feature_layers=head.feature_layers).features
        fused = head.fuse_features(feats)
        fuse_d = _diff(ort_head.fuse_features(feats), fused)
        ids = torch.randint(0, V, (batch, T), generator=gen)
        parents = _random_tree(T, batch, gen)
        mask, pos = ancestor_matrix(parents), P + tree_depths(parents)
        cache = KVCache()
        if P:
            head(seq[:, :P], fused[:, :P], cache=cache)
            cache.commit()
        full = torch.cat([torch.ones(batch, T, P, dtype=torch.bool), mask], dim=-1)
        ref_h = head(ids, fused[:, P:], position_ids=pos, attention_mask=full, cache=cache)
        ref_logits = head.compute_logits(ref_h)
        c2 = KVCache()
        if P:
            ort_head(seq[:, :P], fused[:, :P], cache=c2)
            c2.commit()
        got_h = ort_head(ids, fused[:, P:], position_ids=pos, attention_mask=full, cache=c2)
        rows.append({"tree_size": T, "past_len": P, "hidden": _diff(got_h, ref_h),
                     "logits": _diff(ort_head.compute_logits(got_h), ref_logits),
                     "kv": max(_diff(getattr(c2.hf.layers[0], a), getattr(cache.hf.layers[0], a)) for a in ("keys", "values")),
                     "fuse": fuse_d, "hidden_scale": _scale(ref_h)})
    # the drafter's tree-expansion call pattern (partial past per row) against the PyTorch head
    rows.append(_eagle_partial_past_row(head, ort_head, fused[:1], gen, V))
    return {"max": _summarise(rows, ("hidden", "logits", "kv", "fuse")), "shapes": rows}


def _eagle_partial_past_row(head, ort_head, fused, gen, V) -> dict:
    """Nodes that each see the committed prefix plus only some earlier draft entries (as in
    EAGLE-2 tree growth): exercises :class:`OrtEagleHead`'s one-row-per-token path."""
    n_commit = fused.shape[1] - 1
    ids = torch.randint(0, V, (1, n_commit + 1), generator=gen)
    c_ref, c_ort = KVCache(), KVCache()
    for c, h in ((c_ref, head), (c_ort, ort_head)):
        h(ids[:, :n_commit], fused[:, :n_commit], cache=c)
        c.commit()
    # depth 1: three siblings (each sees the prefix and itself)
    m = 3
    sib_ids = torch.randint(0, V, (1, m), generator=gen)
    sib_h = fused[:, -1:].expand(1, m, -1)
    allowed = torch.cat([torch.ones(m, n_commit, dtype=torch.bool), torch.eye(m, dtype=torch.bool)], 1)[None]
    pos = torch.full((1, m), n_commit, dtype=torch.long)
    outs = []
    for c, h in ((c_ref, head), (c_ort, ort_head)):
        o1 = h(sib_ids, sib_h, position_ids=pos, attention_mask=allowed, cache=c)
        c.commit()
        # depth 2: children of siblings 2 and 0 (each sees the prefix, its parent, itself)
        rows = torch.zeros(2, m + 2, dtype=torch.bool)
        rows[0, 2] = rows[1, 0] = True
        rows[0, m] = rows[1, m + 1] = True
        allowed2 = torch.cat([torch.ones(2, n_commit, dtype=torch.bool), rows], 1)[None]
        o2 = h(sib_ids[:, [2, 0]], o1[:, [2, 0]], position_ids=pos[:, :2] + 1, attention_mask=allowed2, cache=c)
        c.commit()
        outs.append((o1, o2, h.compute_logits(o2)))
    (r1, r2, rl), (g1, g2, gl) = outs
    return {"tree_size": "2-level partial past", "past_len": n_commit, "hidden": max(_diff(g1, r1), _diff(g2, r2)),
            "logits": _diff(gl, rl),
            "kv": max(_diff(getattr(c_ort.hf.layers[0], a), getattr(c_ref.hf.layers[0], a)) for a in ("keys", "values")),
            "fuse": 0.0, "hidden_scale": _scale(r2)}


@torch.inference_mode()
def _medusa_parity(heads: MedusaHeads, target: TargetModel, path, shapes, batch: int, seed: int, threads) -> dict:
    ort_heads = OrtMedusaHeads(path, threads=threads)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for T, _ in shapes:
        seq = torch.randint(0, target.vocab_size, (batch, T), generator=gen)
        h = target.forward(seq, target.new_cache(), feature_layers=heads.feature_layers).features[:, :, 0]
        rows.append({"tree_size": T, "logits": _diff(ort_heads(h), heads(h))})
    return {"max": _summarise(rows, ("logits",)), "shapes": rows}


def parity_report(target: TargetModel, head=None, out_dir=".", *, variants=VARIANTS, tree_sizes=(1, 4, 9),
                  past_lengths=(0, 3, 17), batch: int = 2, seed: int = 0, threads: int | None = 1) -> dict:
    """Max abs differences, onnxruntime CPU vs PyTorch, for the graphs in ``out_dir`` (named as
    :func:`graph_paths`) at every (tree size, past length) pair, per variant. The target graph
    must output (at least) ``head.feature_layers``, as :func:`export_all` exports it."""
    shapes = [(T, P) for T in tree_sizes for P in past_lengths]
    feature_layers = tuple(head.feature_layers) if head is not None else ()
    out = {}
    for variant in variants:
        p = graph_paths(out_dir, variant)
        entry = {"target": _target_parity(target, p["target"], feature_layers, shapes, batch, seed, threads)}
        if isinstance(head, (EagleHead, Eagle3Head)):
            entry["speculator"] = _eagle_parity(head, target, p["speculator"], shapes, batch, seed, threads)
        elif isinstance(head, MedusaHeads):
            entry["speculator"] = _medusa_parity(head, target, p["speculator"], shapes, batch, seed, threads)
        out[variant] = entry
    return out


# --------------------------------------------------------------------------- end to end


def _torch_drafter(head, options: dict):
    if isinstance(head, (EagleHead, Eagle3Head)):
        from specfoundry.runtime.drafters.eagle import Eagle3Drafter

        return (Eagle3Drafter if isinstance(head, Eagle3Head) else EagleDrafter)(head, **options)
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, **options)
    raise TypeError(f"no drafter for {type(head).__name__}")


@torch.inference_mode()
def _top2_gap(target: TargetModel, context: list[int]) -> float:
    """Top-2 logit gap of the PyTorch target's next-token logits after ``context``."""
    cache = target.new_cache()
    logits = target.forward(torch.tensor([context]), cache, logits_for=torch.tensor([len(context) - 1])).logits[0, -1]
    top = logits.double().topk(2).values
    return float(top[0] - top[1])


def compare_greedy(target: TargetModel, prompt, ref: list[int], got: list[int]) -> dict:
    """Compare two greedy continuations of ``prompt``: ``{"equal", "first_divergence",
    "top2_gap", "near_tie"}``; at a divergence, ``top2_gap`` is the PyTorch target's top-2
    logit gap after ``prompt + ref[:j]`` and ``near_tie`` is ``top2_gap < NEAR_TIE``."""
    n = min(len(ref), len(got))
    j = next((i for i in range(n) if ref[i] != got[i]), None)
    if j is None and len(ref) != len(got):
        j = n
    res = {"equal": j is None, "first_divergence": j, "top2_gap": None, "near_tie": False}
    if j is not None:
        gap = _top2_gap(target, list(prompt) + ref[:j])
        res.update(top2_gap=gap, near_tie=gap < NEAR_TIE)
    return res


def greedy_end_to_end(target: TargetModel, head, target_path, speculator_path, prompts: list[list[int]], *,
                      max_new_tokens: int = 24, drafter_options: dict | None = None, threads: int | None = 1) -> dict:
    """Greedy speculative decoding with target and speculator in onnxruntime vs the PyTorch
    runtime (same generator, verifier and drafter logic; ``adaptive=False``, fixed draft shape).

    Per prompt: ``ort_vs_torch`` (ORT speculative vs PyTorch speculative) and ``ort_vs_plain``
    (vs plain PyTorch greedy), each ``{"equal", "first_divergence", "top2_gap", "near_tie"}``;
    plus tau for both. ``all_equal`` is True only if every comparison matched exactly;
    ``unexplained`` counts divergences that are *not* near-ties."""
    options = dict(drafter_options or {})
    ort_target = OrtTarget.like(target_path, target, threads=threads)
    ort_drafter = load_ort_drafter(speculator_path, threads=threads, **options)
    torch_drafter = _torch_drafter(head, options)
    results = []
    t0 = time.perf_counter()
    for prompt in prompts:
        kw = dict(prompt_ids=list(prompt), max_new_tokens=max_new_tokens, stop_at_eos=False)
        plain = SpeculativeGenerator(target).generate(speculate=False, **kw)
        ref = SpeculativeGenerator(target, torch_drafter, adaptive=False).generate(**kw)
        got = SpeculativeGenerator(ort_target, ort_drafter, adaptive=False).generate(**kw)
        results.append({
            "prompt_len": len(prompt),
            "ort_tokens": got.token_ids,
            "ort_vs_torch": compare_greedy(target, prompt, ref.token_ids, got.token_ids),
            "ort_vs_plain": compare_greedy(target, prompt, plain.token_ids, got.token_ids),
            "torch_vs_plain": compare_greedy(target, prompt, plain.token_ids, ref.token_ids),
            "tau_ort": got.stats.tau,
            "tau_torch": ref.stats.tau,
        })
    cmp_keys = ("ort_vs_torch", "ort_vs_plain", "torch_vs_plain")
    return {
        "prompts": results,
        "all_equal": all(r[k]["equal"] for r in results for k in cmp_keys),
        "near_ties": sum(r[k]["near_tie"] for r in results for k in cmp_keys),
        "unexplained": sum((not r[k]["equal"]) and not r[k]["near_tie"] for r in results for k in cmp_keys),
        "seconds": time.perf_counter() - t0,
    }


def _default_prompts(target: TargetModel, seed: int) -> list[list[int]]:
    if target.tokenizer is not None:
        return [target.encode_chat([{"role": "user", "content": q}])
                for q in ("What is the capital of France?", "Write a haiku about the sea.")]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist() for n in (5, 12)]


def export_all(target: TargetModel, head, out_dir, *, variants=VARIANTS, parity: bool = True,
               end_to_end: bool = True, prompts: list[list[int]] | None = None, max_new_tokens: int = 24,
               drafter_options: dict | None = None, tree_sizes=(1, 4, 9), past_lengths=(0, 3, 17),
               threads: int | None = 1, seed: int = 0) -> dict:
    """Export the target and the speculator ``head`` in every variant to ``out_dir`` (names as
    :func:`graph_paths`) and return the report entry: per-variant graph facts, parity figures
    (:func:`parity_report`) and end-to-end greedy results (:func:`greedy_end_to_end`)."""
    from ..source import check_module_finite

    check_module_finite(head, "the speculator")  # NaN/inf weights make every graph unusable
    out = Path(out_dir)
    report = {"out_dir": str(out), "opset": 23, "graphs": {}, "seconds": {}}
    t0 = time.perf_counter()
    for variant in variants:
        p = graph_paths(out, variant)
        report["graphs"][variant] = {
            "target": export_onnx(target, p["target"], variant, feature_layers=head.feature_layers),
            "speculator": export_onnx(head, p["speculator"], variant),
        }
    report["seconds"]["export"] = time.perf_counter() - t0
    if parity:
        t0 = time.perf_counter()
        report["parity"] = parity_report(target, head, out, variants=variants, tree_sizes=tree_sizes,
                                         past_lengths=past_lengths, seed=seed, threads=threads)
        report["seconds"]["parity"] = time.perf_counter() - t0
    if end_to_end:
        prompts = prompts if prompts is not None else _default_prompts(target, seed)
        report["end_to_end"] = {}
        for variant in variants:
            p = graph_paths(out, variant)
            report["end_to_end"][variant] = greedy_end_to_end(
                target, head, p["target"], p["speculator"], prompts, max_new_tokens=max_new_tokens,
                drafter_options=drafter_options, threads=threads)
    return report
