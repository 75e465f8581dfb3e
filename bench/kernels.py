"""Linear-kernel table for a target's weights on this machine: ms per forward's worth of matrix
products for each of the engine's kernels (:data:`specfoundry.runtime.engine.KERNELS`) and row
counts, so the draft shapes and the engine's kernel choice can be checked against measurement.

    python -m specfoundry.bench.kernels --target smollm2-135m --dtype bfloat16 --threads 1

Every matrix of the target (fused QKV, output, fused gate/up, down, LM head) is multiplied once
per row count; best of ``--reps``. Ratios within one run are what to read (the machine is shared).
"""

from __future__ import annotations

import argparse

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kernel_table(engine, rows=(1, 2, 4, 8, 16, 32), reps: int = 3) -> dict[str, dict[int, float]]:
    """``{kernel: {rows: ms}}`` over all of ``engine``'s matrices (kernels this build lacks are left out)."""
    from specfoundry.runtime.engine import _MATRICES, KERNELS
    from specfoundry.runtime.timing import best_seconds

    mats = [w[k] for w in engine._matrix_holders() for k in _MATRICES if k in w]
    out = {}
    for name, (prepare, apply) in KERNELS.items():
        if name == "avx512bf16" and mats[0].dtype != torch.bfloat16:
            continue  # bf16 products only (other dtypes would time ATen's under its name)
        try:
            prepared = [prepare(m) for m in mats]
            apply(torch.zeros(1, mats[0].shape[1], dtype=mats[0].dtype), prepared[0])
        except (RuntimeError, AttributeError, ValueError):  # not in this build / not on this CPU / these shapes
            continue
        out[name] = {}
        for n in rows:
            if name == "gemv_t" and n > 1:
                continue  # a one-row kernel
            xs = [torch.randn(n, m.shape[1], dtype=m.dtype) for m in mats]
            with torch.inference_mode():
                out[name][n] = 1000 * best_seconds(lambda: [apply(x, p) for x, p in zip(xs, prepared)], reps)
        del prepared
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specfoundry.runtime.models import load_target

    target = load_target(args.target, dtype=DTYPES[args.dtype], backend="engine")
    table = kernel_table(target.engine, reps=args.reps)
    rows = sorted({n for t in table.values() for n in t})
    mb = sum(w[k].numel() * w[k].element_size() for w in target.engine._matrix_holders() for k in w
             if "@" not in k and isinstance(w[k], torch.Tensor) and w[k].dim() == 2) / 1e6
    print(f"{args.target} {args.dtype}, {args.threads} thread(s), {mb:.0f} MB of matrices; "
          f"engine's choice (one row, several rows): {target.engine.kernels}")
    print("| kernel | " + " | ".join(f"{n} row{'s' if n > 1 else ''}" for n in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name, t in table.items():
        print(f"| {name} | " + " | ".join(f"{t[n]:.1f} ms" if n in t else "-" for n in rows) + " |")


if __name__ == "__main__":
    main()
