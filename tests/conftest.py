"""Shared fixtures: tiny random Llama targets (float64, exact) and the real SmolLM2-135M."""

import os

import pytest
import torch

from tiny_models import tiny_llama

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
