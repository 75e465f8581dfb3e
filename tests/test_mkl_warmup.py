"""The MKL VML warm-up (runtime/mkl_warmup.py): importing the runtime resolves VML's kernels before a
parallel op can race on a first call, so a fresh process's first parallel cos (the RoPE table's) is exact.

The race is a timing one. On the forty-eighth session's Xeon (oneMKL 2024.2) it showed in 2 of 60, 9 of 57
and 1 of 48 fresh 2-thread processes that imported only torch (1 of 70 that imported transformers too: rarer,
which is why the process test loads the warm-up module by its path, without the package), and in none of
97 with an 8-element cos first. With the warm-up disabled, 24 such processes (three at once) caught it in 2 of 4
runs there; the test runs 12 (~16 s, its share of the default tier), so on that machine it catches a warm-up
that does nothing about one run in three, and passes trivially where MKL does not race (other CPUs, other MKL
builds). The engine's own guard, RoPE tables computed until two agree, is pinned deterministically in
test_engine.py."""

import subprocess
import sys
from pathlib import Path

import torch

from specfoundry.runtime import mkl_warmup

# the engine's RoPE-table pattern: the process's first parallel op is a 64k-element fp32 cos, run again after
_FIRST_COS = """
import sys, torch
import importlib.util
spec = importlib.util.spec_from_file_location("mkl_warmup", {path!r})  # torch only: no transformers import
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module.warm()
torch.set_num_threads(2)
inv = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
def table():
    f = torch.arange(1024)[None, :, None].float() * inv
    return torch.cat((f, f), -1).cos()
first, again = table(), table()
print(int((first != again).sum()), float((first.double() - again.double()).abs().max()))
"""


def test_importing_the_runtime_warms_every_vml_function():
    assert mkl_warmup._done  # the package import ran it
    assert "cos" in mkl_warmup.VML_FUNCTIONS and "exp" in mkl_warmup.VML_FUNCTIONS
    assert all(hasattr(torch, name) for name in ("cos", "sin", "exp", "log", "sqrt", "tanh", "erf"))
    mkl_warmup.warm()  # idempotent


def test_a_fresh_processs_first_parallel_cos_is_exact_after_the_warm_up():
    code = _FIRST_COS.format(path=str(Path(mkl_warmup.__file__)))
    for _ in range(4):  # fresh processes, the race being a first call's; three at once: busy cores made it likelier
        runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(3)]
        for run in runs:
            out, err = run.communicate(timeout=120)
            assert run.returncode == 0, err[-2000:]
            differing, worst = out.split()
            assert int(differing) == 0, f"first cos table differs in {differing} entries (up to {worst})"
