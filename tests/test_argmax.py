"""The runtime's greedy argmax (widened on CPU for bf16/fp16) picks exactly what ``Tensor.argmax``
picks: same index, first of tied maxima, NaN as maximal."""

import pytest
import torch

from specfoundry.runtime.sampling import argmax


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_argmax_equals_tensor_argmax_with_ties_and_nan(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 7, 500, generator=g) * 4).round().to(dtype)  # rounding makes many ties
    x[0, 0, 10] = x[0, 0, 20] = x[0, 0].max() + 1  # a tie at the top: the first index wins
    x[1, 2, 33] = float("nan")
    out = argmax(x)
    assert out.dtype == torch.long and out.shape == (3, 7)
    assert torch.equal(out, x.argmax(-1))
    assert out[0, 0] == 10 and out[1, 2] == 33
