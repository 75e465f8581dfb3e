"""Shared fixtures: tiny random Llama targets (float64, exact) and the real SmolLM2-135M."""

import os

# Under pytest-xdist (`make test` runs two workers) each worker and the processes its tests start
# get one OpenMP thread that sleeps when idle: two 2-thread processes on 2 cores spin against each
# other (a training run beside a test run was seen at 7 s a step, several times its pace alone). Set
# before torch loads libgomp, which reads these once.
_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if _XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Each test measures the machine's choices (the engine's kernels, dtype auto, the FMA path) for what it set
# up: runtime/choices.py keeps them across processes otherwise; tests/test_choices.py and test_autodtype.py turn
# that on under a temporary cache.
os.environ.setdefault("SPECFOUNDRY_CHOICES", "measure")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny_models import tiny_llama  # noqa: E402

torch.set_num_threads(1 if _XDIST_WORKER else max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    """Convert the built-in target once, before xdist workers start, so they do not race to."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None):
        return  # a worker, or a run in one process (its fixtures convert it when a test needs it)
    from specfoundry.runtime.models import DEFAULT_TARGET, MissingTargetPackage, builtin_model_dir

    try:
        builtin_model_dir(DEFAULT_TARGET)
    except MissingTargetPackage:
        pass  # the tests that need it say so themselves


@pytest.fixture(scope="module")
def single_thread():
    """Run a module of tiny-tensor tests on one intra-op thread: on a shared 2-core machine,
    threading tiny ops only adds barrier waits (measured ~6x slower under load)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def smollm2():
    from specfoundry.runtime import load_target

    return load_target("smollm2-135m")
