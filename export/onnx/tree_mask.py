"""Bit-packed tree masks: the mask format of the ``specfoundry::TreeAttention`` contract.

Scope: conversion between a bool tree mask ``[B, T, T]`` (``m[b, i, t]`` True = new token ``i``
may attend to new token ``t``) and the packed int32 form ``[B, T, W]``, ``W = ceil(T / 32)``:
bit ``t % 32`` of word ``t // 32`` is set when token ``t`` is visible (TensorRT-LLM's
convention). Bit 31 is the int32 sign bit, so a word with token ``32w + 31`` visible is
negative. Shared by the ONNX export, the ONNX reference function, the Triton kernel and the
TensorRT plugin; pure torch, no ONNX imports.
"""

from __future__ import annotations

import torch

__all__ = ["BITS", "tree_mask_words", "pack_tree_mask", "unpack_tree_mask"]

BITS = 32


def tree_mask_words(num_tokens: int) -> int:
    """``W = ceil(T / 32)``: int32 words per mask row for ``T`` new tokens."""
    return (int(num_tokens) + BITS - 1) // BITS


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[..., T, T]`` -> int32 ``[..., T, W]`` (leading dims kept; usually ``[B, T, T]``)."""
    mask = torch.as_tensor(mask)
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"tree mask must be [..., T, T], got {tuple(mask.shape)}")
    T = mask.shape[-1]
    W = tree_mask_words(T)
    bits = torch.zeros(*mask.shape[:-1], W * BITS, dtype=torch.int64, device=mask.device)
    bits[..., :T] = mask.to(torch.bool).to(torch.int64)
    weights = torch.ones(BITS, dtype=torch.int64, device=mask.device) << torch.arange(BITS, device=mask.device)
    words = (bits.view(*mask.shape[:-1], W, BITS) * weights).sum(-1)  # in [0, 2^32)
    # reinterpret as int32 (two's complement): values >= 2^31 wrap to negative
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_tree_mask(packed: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
    """Int32 ``[..., T, W]`` -> bool ``[..., T, num_tokens]`` (default ``num_tokens = T``)."""
    packed = torch.as_tensor(packed)
    if packed.dim() < 2:
        raise ValueError(f"packed tree mask must be [..., T, W], got {tuple(packed.shape)}")
    T = packed.shape[-2] if num_tokens is None else int(num_tokens)
    if packed.shape[-1] != tree_mask_words(T):
        raise ValueError(f"packed tree mask has {packed.shape[-1]} words per row; {T} tokens need {tree_mask_words(T)}")
    t = torch.arange(T, device=packed.device)
    words = packed.to(torch.int64).index_select(-1, t // BITS)  # sign extension keeps bit 31
    return (words & (torch.ones_like(t) << (t % BITS))) != 0
