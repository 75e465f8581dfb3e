"""A prepared GPU run (``make gpu-run``): one script of at most ~7 minutes for an NVIDIA machine.

    python tools/gpu_run.py [--out runs/gpu-run] [--budget-s 420] [--sections a,b,...]

Sections, in order; each reports ``ok`` / ``failed`` / ``skipped`` (with the reason) in
``<out>/gpu_run.json``, which is also printed:

1. ``env``             torch / CUDA / GPU / triton / tensorrt versions (runs everywhere).
2. ``train``           the default recipe (``eagle3-smollm2-135m``) trained briefly on CUDA in bf16
                       through ``specfoundry train`` (preflight included): single-gpu launcher,
                       128 Magpie prompts, <= 45 s of data, <= 1 min of training, <= 30 s of evaluation, tau measured at
                       the end; the run lands in ``<out>/train``.
3. ``decode_hf``       speculative decoding on CUDA (bf16, greedy, 4 built-in prompts x 128 tokens)
                       on the HF path: plain vs speculative, tau, speed-up (a warm round; the cold
                       round's seconds beside it), identical output and the float32 lossless verdict. The
                       drafter is section 2's EAGLE-3 head when it trained, else n-gram.
4. ``decode_engine``   the same on the static-cache engine, eager (``cuda_graphs=False``), and the
                       SDPA probe of first-seen key lengths (``sdpa_new_length_ms``).
5. ``decode_graphs``   the same on the engine with CUDA graphs (``runtime.cuda_graph.GraphedTarget``,
                       what ``SpeculativeGenerator`` uses on CUDA by default),
                       plus eager vs graphed ms per bucket (``cuda_graph.measure``).
6. ``tree_attention``  the Triton tree-attention kernel vs SDPA (explicit mask) on Llama-3-8B
                       attention shapes (32/8 heads, head_dim 128, 1024 past tokens), and the verify
                       cost of 16/32/64 tree tokens relative to 1 token on a random-weight
                       Llama-3-8B (bf16, the engine's forward).
7. ``tensorrt``        where ``tensorrt`` imports: ``export.trt.gpu_check``'s golden and TensorRT
                       sections (the plugin engines vs ONNX Runtime golden outputs).

Without a CUDA device every section but ``env`` is ``skipped`` with the reason and the exit code
is 0; a failed section makes it 1. Sections that would start past the budget are skipped ("time
budget"). ``--device cpu`` (tests) runs the decode sections on the CPU with ``--target``.

It lives in ``tools/`` because it spans the layers (training through the ``specfoundry train``
command, the runtime, the export package's Triton kernel), which the packages may not import
across (tests/test_project_layout.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

SECTIONS = ("env", "train", "decode_hf", "decode_engine", "decode_graphs", "tree_attention", "tensorrt")
PROMPTS = ["Explain how a hash map works, with an example in Python.",
           "Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "What are the main causes of inflation? Answer in a few paragraphs.",
           "Translate to French: 'The weather is nice today, let's go for a walk in the park.'"]
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def train_overrides(out: Path) -> dict:
    """``--set`` overrides of the default recipe for the short CUDA bf16 training (section 2)."""
    return {"target.device": "cuda", "launcher.config": "single-gpu", "target.dtype": "bf16",
            "training.precision": "bf16", "data.prompts.0.count": 128, "data.responses.max_new_tokens": 128,
            "data.responses.batch_size": 64, "data.max_minutes": 0.75, "data.eval_prompts": 8,
            "training.max_minutes": 1.0, "training.epochs": 4, "training.log_every": 20,
            "evaluation.limit": 4, "evaluation.max_new_tokens": 64, "evaluation.temperatures": "[0.0]",
            "evaluation.max_minutes": 0.5, "output_dir": str(Path(out) / "train"),
            "data.cache_dir": str(Path(out) / "cache"), "tracking.wandb_mode": "offline"}


def attention_compare(device: str, dtype, hq: int, hkv: int, d: int, past: int, ns=(1, 16, 32, 64),
                      reps: int = 50) -> dict:
    """The Triton tree-attention kernel vs SDPA (explicit bool mask, K/V repeated for GQA) per tree
    size ``n``: microseconds per call and the largest output difference. CUDA, or the CPU under
    TRITON_INTERPRET=1 (tests)."""
    import torch
    import torch.nn.functional as F

    from specfoundry.export.trt import kernel as K
    from specfoundry.runtime.timing import best_seconds

    dev = torch.device(device)
    out = {}
    for n in ns:
        q, k, v, m, scale = K.make_case(1, hq, hkv, n, past, d, dtype, device=device, seed=0)
        dense = K.unpack_tree_mask(m, n).to(dev)  # [B, T, T] bool
        full = torch.cat([torch.ones(1, n, past, dtype=torch.bool, device=dev), dense], dim=2)[:, None]
        kk, vv = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))

        def sdpa():
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=full, scale=scale)

        def triton():
            return K.tree_attention(q, k, v, m, scale)

        err = float((triton().float() - sdpa().float()).abs().max())
        out[n] = {"triton_us": round(1e6 * best_seconds(triton, reps, dev), 1),
                  "sdpa_us": round(1e6 * best_seconds(sdpa, reps, dev), 1), "max_abs_diff": err}
    return out


def verify_cost(config: dict, device: str, dtype, past: int = 1024, ns=(1, 16, 32, 64), reps: int = 10) -> dict:
    """ms of one engine forward of ``n`` tokens over ``past`` cached ones, per ``n``, on a random
    Llama of ``config`` (built directly on ``device`` in ``dtype``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specfoundry.runtime.timing import best_seconds
    from specfoundry.runtime.models import wrap_target

    dev = torch.device(device)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype on the device: no fp32 copy of 8B weights
    try:
        with dev:
            model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(default)
    target = wrap_target(model, name="llama-random", backend="engine")
    cache = target.new_cache(capacity=past + max(ns))
    out = {}
    with torch.inference_mode():
        target.forward(torch.randint(0, config["vocab_size"], (1, past), device=dev), cache)
        cache.commit()
        for n in ns:
            ids = torch.randint(0, config["vocab_size"], (1, n), device=dev)

            def step():
                target.forward(ids, cache)
                cache.rollback()

            out[n] = 1e3 * best_seconds(step, reps, dev)
    return out


def sdpa_new_lengths(device: str, dtype, lengths=range(300, 308), reps: int = 3) -> dict:
    """ms of the engine's attention call (:func:`~specfoundry.runtime.kvcache.grouped_attention`,
    SmolLM2's heads, one new token, a bool mask) the first time a key length is seen and when it is
    seen again (median over ``lengths``), with PyTorch's own SDPA backend choice and with the
    engine's (``kvcache.CUDA_SDPA_BACKENDS``, cuDNN's left out): whether per-shape setup is what
    made first-seen lengths cost ~4x on an H200. Distinct lengths per setting, so neither inherits
    the other's caches."""
    import statistics

    import torch

    from specfoundry.runtime import kvcache

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for k, (label, backends) in enumerate((("pytorch_choice", ()), ("engine", kvcache.CUDA_SDPA_BACKENDS))):
        first, again = [], []
        was = kvcache.CUDA_SDPA_BACKENDS
        kvcache.CUDA_SDPA_BACKENDS = backends
        try:
            for S in lengths:
                S = S + 1000 * k
                q = torch.randn(1, 1, 9, 64, device=dev, dtype=dtype)
                kv = torch.randn(2, 1, 3, S, 64, device=dev, dtype=dtype)
                mask = torch.ones(1, 1, 3, S, dtype=torch.bool, device=dev)
                times = []
                for _ in range(1 + reps):
                    sync()
                    t0 = time.perf_counter()
                    kvcache.grouped_attention(q, kv[0], kv[1], mask, 0.125)
                    sync()
                    times.append(1e3 * (time.perf_counter() - t0))
                first.append(times[0])
                again.append(min(times[1:]))
        finally:
            kvcache.CUDA_SDPA_BACKENDS = was
        out[label] = {"first_ms": round(statistics.median(first), 3), "again_ms": round(statistics.median(again), 3)}
    return out


class Skip(Exception):
    """A section that cannot run here (the reason is the message)."""


def _version(mod: str) -> str | None:
    """The installed version of ``mod`` (None when it is not installed), without importing it."""
    from importlib import metadata

    if importlib.util.find_spec(mod) is None:
        return None
    try:
        return metadata.version(mod)
    except metadata.PackageNotFoundError:
        return "?"


def cuda_reason() -> str | None:
    """None when CUDA is usable, else why not (one line)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch does not import ({e})"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build"
        return f"no CUDA device (torch {torch.__version__}, {build})"
    return None


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.t0 = time.perf_counter()
        self.state: dict = {}
        import torch

        self.device = args.device if args.device != "auto" else ("cuda" if cuda_reason() is None else "none")
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def need_device(self):
        if self.device == "none":
            raise Skip(cuda_reason() or "no CUDA device")

    def need_cuda(self):
        reason = cuda_reason()
        if reason or self.device != "cuda":
            raise Skip(reason or f"needs CUDA (running on {self.device})")

    # ---------------------------------------------------------------------------------------
    def env(self):
        import platform

        import torch

        info = {"python": platform.python_version(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
                "cuda_available": torch.cuda.is_available(), "triton": _version("triton"),
                "tensorrt": _version("tensorrt"), "transformers": _version("transformers"),
                "deepspeed": _version("deepspeed"), "device": self.device}
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            info["driver_free_gb"] = round(torch.cuda.mem_get_info(0)[0] / 1e9, 1)
        return info

    def train(self):
        self.need_cuda()
        run = self.out / "train"
        sets = train_overrides(self.out)
        cmd = [sys.executable, "-m", "specfoundry.runtime.cli", "train", self.args.recipe, "--overwrite"]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = {**os.environ, "WANDB_MODE": "offline"}
        log = self.out / "train.log"
        # leave ~150 s for the decode sections that follow, when they were asked for
        later = {"decode_hf", "decode_engine", "decode_graphs", "tree_attention", "tensorrt"}
        reserve = 150.0 if later & {s.strip() for s in self.args.sections.split(",")} else 10.0
        with open(log, "w") as f:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(60.0, min(300.0, self.left() - reserve)))
        if proc.returncode != 0:
            tail = log.read_text()[-1500:]
            raise RuntimeError(f"specfoundry train exited {proc.returncode}; log {log}: ...{tail}")
        summary = json.loads((run / "train_summary.json").read_text())
        self.state["speculator"] = str(run / "speculator")
        return {k: summary.get(k) for k in ("steps", "tokens_trained", "train_seconds", "data_seconds", "wall_seconds",
                                            "predicted_tau", "measured")}

    def _drafter_source(self):
        return self.state.get("speculator") or self.args.drafter

    def _decode(self, backend: str, graphs: bool = False, options: dict | None = None):
        import torch

        from specfoundry.runtime import SpeculativeGenerator, load_drafter, load_target
        from specfoundry.runtime.lossless import compare_greedy

        self.need_device()
        dev = "cuda" if self.device == "cuda" else "cpu"
        target = load_target(self.args.target, device=dev, dtype=self.dtype, backend=backend)
        spec_target = target
        if graphs:
            from specfoundry.runtime.cuda_graph import GraphedTarget

            spec_target = GraphedTarget(target)
        source = self._drafter_source()
        drafter = load_drafter(source, target=target, **(options or {}))
        # the generator graphs CUDA engine targets itself (and a head's drafting); the eager section keeps them eager
        gen = SpeculativeGenerator(spec_target, drafter, cuda_graphs=None if graphs else False,
                                   **({"adaptive": False} if options else {}))
        n_tok = self.args.max_new_tokens
        gen.generate(prompt=PROMPTS[0], max_new_tokens=16, speculate=False)  # warm-up (kernels, graphs)
        gen.generate(prompt=PROMPTS[0], max_new_tokens=16)
        # Two rounds over the prompts. The first run at a context length it has not seen pays one-time
        # costs on CUDA (an H200 eager step: ~48 ms the first time, ~12 ms after), so a plain run first
        # and the speculative run after it on the same prompt made speculation look 3x faster at
        # tau 1.1 (session 25). Round "cold" alternates which runs first; round "warm" repeats the
        # prompts (every length seen) and gives the speed-up.
        secs = {"cold": [0.0, 0.0], "warm": [0.0, 0.0]}  # plain, speculative
        rows, plain_n, spec_n, same, lossless, taus = [], 0, 0, 0, 0, []
        split = [0.0, 0.0, 0.0, 0]  # warm speculative runs: draft s, verify s, decode s, steps
        for rnd in ("cold", "warm"):
            for i, p in enumerate(PROMPTS[: self.args.prompts]):
                res = {}
                for spec in ((False, True) if i % 2 == 0 else (True, False)):
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    res[spec] = gen.generate(prompt=p, max_new_tokens=n_tok, speculate=spec, stop_at_eos=False)
                a, b = res[False], res[True]
                secs[rnd][0] += a.stats.seconds
                secs[rnd][1] += b.stats.seconds
                if rnd == "cold":
                    continue
                st = b.stats
                split[0] += st.draft_seconds
                split[1] += st.verify_seconds
                split[2] += st.seconds - st.prefill_seconds
                split[3] += st.speculative_steps + st.plain_steps
                plain_n += len(a.token_ids)
                spec_n += len(b.token_ids)
                same += a.token_ids == b.token_ids
                # bf16: a flip at a near-tie is rounding; the float32 recomputation is the judge
                cmp = compare_greedy(target, a.prompt_ids, b.token_ids, a.token_ids)
                lossless += cmp.ok
                taus.append(b.stats.tau)
                rows.append({"tau": round(b.stats.tau, 3), "plain_tok_s": round(len(a.token_ids) / a.stats.seconds, 1),
                             "spec_tok_s": round(len(b.token_ids) / b.stats.seconds, 1),
                             "identical": a.token_ids == b.token_ids,
                             **({} if cmp.identical else {"divergence": cmp.as_dict()})})
        plain_s, spec_s = secs["warm"]
        out = {"target": self.args.target, "backend": type(target).__name__ + ("+cuda_graphs" if graphs else ""),
               "dtype": str(self.dtype).removeprefix("torch."), "device": dev, "drafter": str(source),
               "tau": round(sum(taus) / len(taus), 3), "plain_tok_s": round(plain_n / plain_s, 1),
               "spec_tok_s": round(spec_n / spec_s, 1), "speedup": round((spec_n / spec_s) / (plain_n / plain_s), 3),
               "identical": f"{same}/{len(rows)}", "lossless": f"{lossless}/{len(rows)}",
               "cold_round_s": {"plain": round(secs["cold"][0], 2), "speculative": round(secs["cold"][1], 2)},
               # per speculative step (the generator's clocks: draft, verify, the rest of the step)
               "step_ms": {k: round(1e3 * v / max(split[3], 1), 3) for k, v in
                           (("draft", split[0]), ("verify", split[1]), ("overhead", split[2] - split[0] - split[1]))},
               "plain_step_ms": round(1e3 * plain_s / max(plain_n, 1), 3),
               "head_graphs": getattr(getattr(drafter, "_graphed", None), "captures", None),
               "per_prompt": rows}
        if not graphs and dev == "cuda":
            out["sdpa_new_length_ms"] = sdpa_new_lengths("cuda", self.dtype)
        if options:
            out["drafter_options"] = options
        if graphs and dev == "cuda" and not options:
            from specfoundry.runtime.cuda_graph import measure

            out["graph_steps_ms"] = measure(self.args.target, past=256, reps=10,
                                            dtype=str(self.dtype).removeprefix("torch."))
        return out

    def decode_hf(self):
        return self._decode("hf")

    def decode_engine(self):
        return self._decode("engine")

    def decode_graphs(self):
        out = self._decode("engine", graphs=True)
        # the checkpoint's shape was measured on a CPU, where verification is compute-bound; on a GPU
        # verifying 16-64 tokens costs ~1.3x one (tree_attention): EAGLE-2's own wide tree and a chain
        for name, opts in (("eagle2_tree", dict(tree="dynamic", depth=5, top_k=8, total_tokens=32)),
                           ("chain4", dict(tree="chain", depth=4))):
            if self.left() < 30 or not str(self._drafter_source()).strip() or self._drafter_source() == "ngram":
                out[name] = "skipped: time budget or no head"
                continue
            wide = self._decode("engine", graphs=True, options=opts)
            out[name] = {k: v for k, v in wide.items() if k != "per_prompt"}
        return out

    def tree_attention(self):
        self.need_cuda()
        import torch

        hq, hkv, d, past = LLAMA3_8B["num_attention_heads"], LLAMA3_8B["num_key_value_heads"], 128, 1024
        attn = attention_compare("cuda", torch.bfloat16, hq, hkv, d, past)
        verify = verify_cost(LLAMA3_8B, "cuda", torch.bfloat16, past=past)
        torch.cuda.empty_cache()
        return {"attention_llama3_8b_past1024": attn,
                "verify_ms_llama3_8b_random": {n: round(v, 3) for n, v in verify.items()},
                "verify_cost_relative_to_1": {n: round(v / verify[1], 3) for n, v in verify.items()}}

    def tensorrt(self):
        self.need_cuda()
        if _version("tensorrt") is None:
            raise Skip("tensorrt does not import (pip install tensorrt on the NVIDIA machine)")
        out = self.out / "gpu-check"
        cmd = [sys.executable, "-m", "specfoundry.export.trt.gpu_check", "--out", str(out), "--only",
               "golden_cpu,tensorrt"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, self.left() - 10))
        report = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
        sec = report.get("sections", {}).get("tensorrt", {})
        if proc.returncode != 0 and sec.get("status") != "ok":
            raise RuntimeError(f"gpu_check exited {proc.returncode}: {sec.get('reason') or proc.stderr[-800:]}")
        return {"tensorrt": sec}


# minimum seconds a section needs to be worth starting
_MIN_S = {"env": 0, "train": 200, "decode_hf": 25, "decode_engine": 25, "decode_graphs": 40, "tree_attention": 40,
          "tensorrt": 30}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_run.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/gpu-run")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall budget; later sections are skipped past it")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--recipe", default="eagle3-smollm2-135m")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="ngram", help="drafter when no speculator was trained here")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto: cuda when available, else every section is skipped; cpu: decode sections on CPU (tests)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    r = Run(args)
    summary = {"sections": {}, "budget_s": args.budget_s}
    for name in SECTIONS:
        t0 = time.perf_counter()
        if name not in wanted:
            rec = {"status": "skipped", "reason": "not selected (--sections)"}
        elif r.left() < _MIN_S[name]:
            rec = {"status": "skipped", "reason": f"time budget ({r.left():.0f} s left of {args.budget_s:.0f})"}
        else:
            try:
                rec = {"status": "ok", "details": getattr(r, name)()}
            except Skip as s:
                rec = {"status": "skipped", "reason": str(s)}
            except Exception as exc:  # noqa: BLE001 - a failed section must not stop the others
                rec = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000],
                       "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        summary["sections"][name] = rec
        print(f"[gpu-run] {name:15s} {rec['status']:8s} {rec['seconds']:7.1f} s  {rec.get('reason', '')[:200]}",
              file=sys.stderr)
    summary["seconds"] = round(time.perf_counter() - r.t0, 1)
    failed = [n for n, s in summary["sections"].items() if s["status"] == "failed"]
    summary["ok"] = not failed
    text = json.dumps(summary, indent=2, default=str)
    (Path(args.out) / "gpu_run.json").write_text(text)
    print(text)
    print(f"[gpu-run] wrote {Path(args.out) / 'gpu_run.json'}; "
          f"{'all sections ok or skipped' if not failed else 'FAILED: ' + ', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
