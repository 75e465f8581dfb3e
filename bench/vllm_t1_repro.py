"""Minimal repro of a vLLM 0.32.0 CPU bug that breaks speculative decoding at temperature > 0,
and the fix that ``specfoundry check-vllm`` applies in its own vLLM process (never to the
installed files). Runs inside ``.venv-vllm``; imports no specfoundry (``bench/peer_common.py``
and the tests import it from here). Report: ``docs/vllm-cpu-t1-bug.md``.

    .venv-vllm/bin/python bench/vllm_t1_repro.py          # exit 1 while the bug is there

The bug: on CPU without a Triton CPU backend, vLLM replaces the Triton ``expand_kernel`` of
``vllm/v1/sample/rejection_sampler.py`` with ``_expand_kernel_impl`` from
``vllm/utils/cpu_triton_utils.py``. That wrapper hands the C++ op ``_ensure_int64(output)``: for
the float32 buffer that ``expand_batch_to_tokens`` allocates with ``x.new_empty(num_tokens)``
it is a new int64 tensor, the op writes into that copy, and nothing is copied back, so the
caller gets the uninitialised buffer. ``apply_sampling_constraints`` then divides the target
logits of every draft position by those values (``logits.div_(temperature.unsqueeze(-1))``)
before rejection sampling. (Copying the int64 result back is not enough either: the input
temperatures are also cast to int64, 0.7 -> 0, which ``replace_from=0`` then turns into 1.)

Output with vLLM 0.32.0 (``vllm-cpu``, torch 2.13.0+cpu; the garbage differs run to run)::

    input x=[0.7, 1.0, 0.0] (float32), cu_num_tokens=[2, 5, 6], replace 0 -> 1
    expected           [0.7, 0.7, 1, 1, 1, 1]
    vLLM as shipped    [3.3e-12, 6.9e+22, 1.8e+31, 1.8e+25, 1.1e+27, 1.7e+22]  WRONG
    copy-back only     [1, 1, 1, 1, 1, 1]  WRONG
    proposed fix       [0.7, 0.7, 1, 1, 1, 1]  ok
"""

from __future__ import annotations

import json
import sys

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
# the docstring's example of expand_batch_to_tokens, with the temperatures of three requests
# (T=0.7, T=1, greedy) and replace_from=GREEDY_TEMPERATURE=0 -> 1 as apply_sampling_constraints calls it
CASE = {"x": [0.7, 1.0, 0.0], "cu_num_tokens": [2, 5, 6], "num_tokens": 6, "replace_from": 0, "replace_to": 1}


def expected_expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0) -> list:
    """What ``expand_batch_to_tokens`` must return (plain Python, from its docstring):
    ``x = [a, b, c]``, ``cu_num_tokens = [2, 5, 6]`` -> ``[a, a, b, b, b, c]``, with ``replace_from``
    replaced by ``replace_to``."""
    out, start = [], 0
    for v, end in zip(x, cu_num_tokens):
        out += [replace_to if v == replace_from else v] * (end - start)
        start = end
    if len(out) != num_tokens:
        raise ValueError(f"cu_num_tokens ends at {len(out)}, not num_tokens={num_tokens}")
    return out


def check_expand(expand_batch_to_tokens, torch, case: dict | None = None, trials: int = 3, tol: float = 1e-6) -> dict:
    """Call ``expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from, replace_to)``
    (vLLM's, or a stand-in) ``trials`` times on the float32 case; ``ok`` when every call
    returns the expected values. ``observed`` is the first call's output."""
    c = dict(CASE if case is None else case)
    want = expected_expand(c["x"], c["cu_num_tokens"], c["num_tokens"], c["replace_from"], c["replace_to"])
    observed, ok = None, True
    for _ in range(trials):
        x = torch.tensor(c["x"], dtype=torch.float32)
        cu = torch.tensor(c["cu_num_tokens"], dtype=torch.int32)
        got = expand_batch_to_tokens(x, cu, c["num_tokens"], replace_from=c["replace_from"], replace_to=c["replace_to"])
        vals = [float(v) for v in got.tolist()]
        observed = vals if observed is None else observed
        ok = ok and got.dtype == torch.float32 and len(vals) == len(want) and all(
            abs(a - b) <= tol for a, b in zip(vals, want))
    return {"input": c, "expected": [float(v) for v in want], "observed": observed, "ok": bool(ok)}


def fixed_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """The proposed replacement for ``vllm.utils.cpu_triton_utils._expand_kernel_impl``: the
    Triton kernel's semantics for any dtype, written into ``output`` itself. (vLLM's C++ op
    takes int64 tensors only, so int64 in and out still go to it where it is loaded.)"""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    n = int(cu[-1]) if cu.numel() else 0
    if output.dtype == torch.int64 and input_val.dtype == torch.int64 and _cpp_op() is not None:
        _cpp_op()(output, input_val, cu, replace_from, replace_to)
        return
    src = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    output[:n] = torch.repeat_interleave(src, counts).to(output.dtype)


def copy_back_only_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """The obvious one-line fix (copy the int64 result back into ``output``): still wrong for
    float inputs, which the int64 cast truncates. Shown by the repro, not used."""
    import torch

    out_i64 = output if output.dtype == torch.int64 else output.to(torch.int64)
    _cpp_op()(out_i64, input_val.to(torch.int64), cu_num_tokens.to(torch.int64), replace_from, replace_to)
    if out_i64 is not output:
        output.copy_(out_i64.to(output.dtype))


def _cpp_op():
    import torch

    try:
        return torch.ops._C.expand_kernel_impl
    except (AttributeError, RuntimeError):
        return None


def install_fix() -> dict:
    """Use :func:`fixed_expand_kernel_impl` in this process: patch the attribute that
    ``CpuPlatform.register_triton_kernel_overrides`` reads (for a worker that registers later),
    and re-register the override where it is already registered. Returns what was done."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.triton_utils import dispatcher

    done = {"patched": "vllm.utils.cpu_triton_utils._expand_kernel_impl"}
    cpu_tl._expand_kernel_impl = fixed_expand_kernel_impl
    if KERNEL in dispatcher._registry:
        dispatcher.register_kernels({KERNEL: fixed_expand_kernel_impl})
        done["reregistered"] = KERNEL
    return done


def vllm_expand(fix: bool = False, register: bool = True):
    """vLLM's real ``expand_batch_to_tokens`` with the CPU overrides registered as a vLLM worker
    registers them (``worker_base.py`` calls ``register_triton_kernel_overrides``), optionally
    with the fix installed first."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    current_platform.import_kernels()
    if fix:
        install_fix()
    if register and KERNEL not in dispatcher._registry:
        current_platform.register_triton_kernel_overrides()
    return rejection_sampler.expand_batch_to_tokens


def expand_with(impl, torch):
    """``expand_batch_to_tokens`` (vLLM's code, inlined) over a given kernel implementation:
    lets the repro compare implementations on the same inputs, and the tests run it on fakes."""

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        assert cu_num_tokens.shape[0] == x.shape[0]
        expanded_x = x.new_empty(num_tokens)
        impl(expanded_x, x, cu_num_tokens, replace_from, replace_to)
        return expanded_x

    return expand_batch_to_tokens


def _fmt(vals) -> str:
    return "[" + ", ".join(f"{v:.2g}" if abs(v) and (abs(v) < 1e-3 or abs(v) > 1e4) else f"{v:g}" for v in vals) + "]"


def report(results: dict) -> str:
    c = CASE
    lines = [f"input x={c['x']} (float32), cu_num_tokens={c['cu_num_tokens']}, replace {c['replace_from']} -> "
             f"{c['replace_to']}", f"{'expected':<18} {_fmt(next(iter(results.values()))['expected'])}"]
    for name, r in results.items():
        lines.append(f"{name:<18} {_fmt(r['observed'])}  {'ok' if r['ok'] else 'WRONG'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    import vllm

    args = sys.argv[1:] if argv is None else argv
    shipped = vllm_expand(fix=False)  # the real function, with vLLM's own CPU override
    results = {"vLLM as shipped": check_expand(shipped, torch)}
    if _cpp_op() is not None:
        results["copy-back only"] = check_expand(expand_with(copy_back_only_expand_kernel_impl, torch), torch)
    install_fix()
    results["proposed fix"] = check_expand(shipped, torch)  # the same real function, override re-registered
    print(f"vllm {vllm.__version__}, torch {torch.__version__}")
    print(report(results))
    if "--json" in args:
        print(json.dumps(results))
    return 0 if results["vLLM as shipped"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
