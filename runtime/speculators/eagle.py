"""EAGLE speculator heads: ``EagleHead`` (EAGLE-1, type ``"eagle"``) and ``Eagle3Head`` (EAGLE-3,
type ``"eagle3"``).

Scope: the ``nn.Module`` definitions only: architecture schema (what a checkpoint's
``architecture`` dict may hold), random init from a target (:meth:`from_target`), the one-step
forward shared by the runtime drafter and by training, and the logits / vocabulary mapping.
The decoder layer they are built on (and its architecture keys) is in :mod:`.eagle_layers`.
Tree search and KV-cache bookkeeping live in ``runtime/drafters/eagle.py``; reading and writing
checkpoints in :mod:`.checkpoint`.

Both heads consume *pairs* ``(h_t, x_{t+1})``: a hidden vector describing token ``t`` (the
target's feature at first, the head's own output while drafting) and the embedding of the next
token. Running the pair at position ``t`` yields the head's hidden state for token ``t + 1``,
whose logits predict token ``t + 2``. RoPE is relative, so only position differences matter.

EAGLE-1 (Li et al. 2024): ``feature_layers = (L,)``: the target's final *normed* hidden state,
exactly what the target's ``lm_head`` consumes. Step input ``fc(cat(embed(x_{t+1}), f_t))``
(2H -> H, with bias), one Llama decoder layer (without its input norm, as in EAGLE), output =
the predicted feature ``f_{t+1}``. Because that feature lives in the already-normed space, the
token logits are ``target.lm_head(f_pred)`` with **no** final norm. While drafting, predicted
features go through ``fc`` like real ones.

EAGLE-3 (Li et al. 2025): features from several target layers (default inputs of layers
``(2, L//2, L-3)``), each RMS-normalised (target activations reach ~2.5e4) before the fusion
``fc: F*H -> H``; one decoder layer whose attention reads ``cat(norm(embed), norm(h))`` (2H
wide); output norm + its own ``lm_head`` over a reduced draft vocabulary (``d2t``: draft id ->
target id, absolute ids; ``t2d``: bool mask over the target vocabulary). While drafting, the
layer's (pre-norm) output replaces the fused feature.

The embedding (both) and the LM head (EAGLE-1) are the target's own modules: held by reference,
not registered as submodules, so they are neither trained nor stored in checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
from typing import ClassVar

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from .. import cpu_layers
from ..engine import (MaskBuffer, PreparedLinears, RopeTable, StaticKVCache, attend, grouped_attention, kernel_for,
                      rms_norm, rotate, tensors_stamp)
from ..kvcache import prefill_causal, row_mask
from ..target import additive_mask, hf_cache_kw
from .vocab import set_draft_vocab
from .eagle_layers import (
    LLAMA_LAYER_SCHEMA,
    Eagle1DecoderLayer,
    Eagle3DecoderLayer,
    layer_arch_from_target,
    layer_architecture_problems,
    layer_config,
)

__all__ = ["EagleHead", "Eagle3Head", "Eagle1DecoderLayer", "Eagle3DecoderLayer", "seeded_init"]


class _EagleBase(nn.Module):
    """What both EAGLE heads share: schema, shared target modules, RoPE, the masked step."""

    type: ClassVar[str] = ""
    ARCHITECTURE_SCHEMA: ClassVar[dict] = {}

    def __init__(self, architecture: dict, embed_tokens: nn.Embedding):
        super().__init__()
        self.architecture = copy.deepcopy(dict(architecture))
        self.config = layer_config(self.architecture)
        self.rotary_emb = LlamaRotaryEmbedding(self.config)  # inv_freq is a non-persistent buffer
        self._rope = RopeTable(self.rotary_emb)  # the drafting step's cos/sin, computed once per position
        self._inv_freq32 = self.rotary_emb.inv_freq.detach().clone().float()  # plain attribute, see _apply
        # a plain dict keeps the target's modules out of parameters(), state_dict() and .to()
        self._shared = {"embed_tokens": embed_tokens}
        self.target_identity: dict | None = None  # set by build/from_target; save_speculator checks it

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # keep RoPE frequencies in float32: .to(bfloat16) would round them (~0.4%) and skew the
        # phase of distant positions; rotary_emb computes cos/sin in float32 anyway
        rot = self.rotary_emb
        rot.inv_freq = self._inv_freq32.to(rot.inv_freq.device)
        rot.original_inv_freq = self._inv_freq32.to(rot.inv_freq.device)
        return self

    # -- facts ---------------------------------------------------------------------------
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.architecture["feature_layers"])

    @property
    def hidden_size(self) -> int:
        return self.architecture["hidden_size"]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared["embed_tokens"]

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.post_attention_layernorm.weight.device

    @property
    def draft_vocab_size(self) -> int:
        return self.architecture["vocab_size"]

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """``[draft_vocab]`` long target ids, or None when the draft vocabulary is the target's."""
        return None

    # -- schema --------------------------------------------------------------------------
    @classmethod
    def architecture_problems(cls, arch: dict, target=None) -> list[tuple[str, str]]:
        """Semantic checks after the type checks: ``[(key, problem), ...]`` (empty when fine)."""
        out = layer_architecture_problems(arch)
        if not arch["feature_layers"]:
            out.append(("feature_layers", "must not be empty"))
        if target is not None:
            if arch["hidden_size"] != target.hidden_size:
                out.append(("hidden_size", f"{arch['hidden_size']} != target hidden size {target.hidden_size}"))
            if arch["vocab_size"] != target.vocab_size:
                out.append(("vocab_size", f"{arch['vocab_size']} != target vocabulary {target.vocab_size}"))
            bad = [i for i in arch["feature_layers"] if not 0 <= i <= target.num_layers]
            if bad:
                out.append(("feature_layers", f"{bad} outside [0, {target.num_layers}] (target hidden_states indices)"))
        return out

    @classmethod
    def default_architecture(cls, target) -> dict:
        raise NotImplementedError

    @classmethod
    def _resolve_architecture(cls, target, overrides: dict) -> dict:
        arch = cls.default_architecture(target)
        unknown = sorted(set(overrides) - set(arch))
        if unknown:
            raise ValueError(f"unknown {cls.type} architecture option(s) {unknown}; allowed: {sorted(arch)}")
        arch.update(copy.deepcopy(overrides))
        if "feature_layers" in overrides:
            arch["feature_layers"] = [int(i) for i in arch["feature_layers"]]
        problems = cls.architecture_problems(arch, target)
        if problems:
            raise ValueError(f"invalid {cls.type} architecture: " + "; ".join(f"{k}: {m}" for k, m in problems))
        return arch

    # -- the step ------------------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[B, n, F, H]`` (layers ``feature_layers``) -> step hidden ``[B, n, H]``."""
        raise NotImplementedError

    def _decode(self, input_ids, hidden, **layer_kwargs) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head output ``[..., H]`` -> logits over the draft vocabulary ``[..., draft_vocab_size]``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Run ``n`` pairs: ``input_ids`` ``[B, n]`` (the *next* tokens) and ``hidden`` ``[B, n, H]``
        (fused features or earlier head outputs) -> head outputs ``[B, n, H]``.

        ``cache`` is an optional :class:`~specfoundry.runtime.target.KVCache` (the new entries are
        left pending, like ``TargetModel.forward``); ``position_ids`` default to
        ``past + arange(n)``; ``attention_mask`` is None (causal), a bool ``[B, n, past + n]``
        (True = may attend) or an additive float ``[B, 1, n, past + n]``.
        """
        if cache is not None:
            cache.check_ready()
        B, n = input_ids.shape
        dev, dt = self.device, self.dtype
        past = cache.length if cache is not None else 0
        input_ids = input_ids.to(dev)
        hidden = hidden.to(dev, dt)
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=dev)).expand(B, n)
        position_ids = position_ids.to(dev)
        if attention_mask is None:
            allowed = torch.ones(n, past + n, dtype=torch.bool, device=dev).tril(past).expand(B, n, past + n)
            attention_mask = allowed
        if attention_mask.dtype == torch.bool:
            attention_mask = additive_mask(attention_mask.to(dev), dt)
        pos_emb = self.rotary_emb(hidden, position_ids)
        out = self._decode(
            input_ids,
            hidden,
            attention_mask=attention_mask.to(dev, dt),
            position_ids=position_ids,
            **hf_cache_kw(cache.hf if cache is not None else None),
            use_cache=cache is not None,
            position_embeddings=pos_emb,
        )
        if cache is not None:
            # same bookkeeping as TargetModel.forward: the new entries stay pending until commit
            cache.mark_appended(n)
        return out

    # -- the drafting step on a static cache --------------------------------------------
    def use_kernels(self, kernels: tuple[str, str] | None, int8: bool = False) -> None:
        """Run the drafting path's linears through the engine's kernels (e.g. the target
        engine's measured choice); None = ``F.linear``. Training's :meth:`forward` is unaffected.
        ``int8``: the few-row products on int8 copies of the weights where the AVX-512 BF16 kernel
        runs them (:class:`~..engine.PreparedLinears`; the drafting step reads half the bytes)."""
        run = self.__dict__["_linears"] = PreparedLinears(kernels, int8=int8) if kernels else None
        # the modules whose weights the drafting step checks are looked up again (a submodule
        # replaced after this call is not seen until the next one; a replaced weight is)
        self.__dict__.pop("_table_modules", None)
        self.__dict__.pop("_draft_norms", None)
        if run is not None:  # at load, not in the first drafting steps
            attn, mlp = self.layer.self_attn, self.layer.mlp
            groups = [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]
            grouped = {id(m) for g in groups for m in g}
            for group in groups + [(m,) for m in self.modules() if isinstance(m, nn.Linear) and id(m) not in grouped]:
                run.prepare(group)

    def _lin(self, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        run = self.__dict__.get("_linears")
        return lin(x) if run is None or torch.is_grad_enabled() else run(lin, x)

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` (a ``LlamaRMSNorm``); outside autograd as the engine's one fused op (HF's
        module runs ~8 ops, and a drafting step has up to 7 norms)."""
        if torch.is_grad_enabled():
            return norm(x)
        return rms_norm(x, norm.weight, norm.variance_epsilon)

    def _lins(self, lins: tuple[nn.Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """``[lin(x) for lin in lins]``; on the engine's kernels as one product (fused weights)."""
        run = self.__dict__.get("_linears")
        if run is None or torch.is_grad_enabled():
            return [lin(x) for lin in lins]
        return list(run.fused(lins, x).split([lin.out_features for lin in lins], dim=-1))

    def _step_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of the decoder layer for pairs ``(hidden, input_ids)``."""
        raise NotImplementedError

    def new_cache(self, capacity: int = 1024) -> StaticKVCache:
        """A preallocated cache for :meth:`step` (one layer, batch 1)."""
        a = self.architecture
        return StaticKVCache(1, a["num_key_value_heads"], a["head_dim"], capacity=capacity, dtype=self.dtype,
                             device=self.device)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, cache: StaticKVCache,
             position_ids: torch.Tensor | None = None, block: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`forward` computes, on a :class:`StaticKVCache` written in place: the drafter's
        step, without per-step cache copies, K/V repeats or masks over the whole context.

        ``block`` bool ``[B, n, k]`` says which of the last ``k`` cache columns (the new tokens
        included) each new token may attend to; everything before them is visible. None = causal.
        """
        cache.check_ready()
        B, n = input_ids.shape
        cache.reserve(n)
        past = cache.length
        dev = self.device
        if position_ids is None:
            position_ids = (past + torch.arange(n, device=dev)).expand(B, n)
        a = self.architecture
        masks = self.__dict__.get("_masks")
        if masks is None or masks.buf.device != dev:
            masks = self.__dict__["_masks"] = MaskBuffer(a["num_attention_heads"] // a["num_key_value_heads"], dev)
        table = self._layer_table(B, n, block, cache)
        if table is not None:  # the whole layer in one C call (cpu_layers)
            x, residual = self._step_inputs(input_ids.to(dev), hidden.to(dev, self.dtype))
            cos, sin = self._rope(position_ids.to(dev), residual)
            out, _ = cpu_layers.run_layers(
                table, residual, cos, sin, cache.kv, past, block, heads=(a["num_attention_heads"], a["num_key_value_heads"]),
                intermediate=a["intermediate_size"], eps=self.layer.post_attention_layernorm.variance_epsilon,
                scale=self.layer.self_attn.scaling, xin=x, keep=True)
            cache.mark_appended(n)
            return out
        causal = prefill_causal(block, past, n, cache.kv.device)  # the prompt's pairs: no mask at all
        mask = None if causal else masks.get(block, B, n, past)

        def attention(q, k, v):
            return attend(cache.kv[0], q, k, v, past, mask, self.layer.self_attn.scaling, causal)

        out = self._layer_step(input_ids, hidden, position_ids, attention)
        masks.release(mask, n if block is None else block.shape[-1])
        cache.mark_appended(n)
        return out

    def _layer_table(self, B: int, n: int, block: torch.Tensor | None, cache: StaticKVCache) -> torch.Tensor | None:
        """The :func:`.cpu_layers.run_layers` weight table of the decoder layer when that runs this
        step (the engine's AVX-512 BF16 products for ``n`` rows, one sequence, bf16; a tree's block
        may cover earlier drafts), else None. Kept while the layer's weights are unchanged (an edited or
        replaced weight is re-prepared and gets a new table)."""
        run = self.__dict__.get("_linears")
        if run is None or B != 1 or kernel_for(run.kernels, n) != "avx512bf16" or self.dtype != torch.bfloat16 \
                or not cache.kv.is_contiguous():
            return None
        a = self.architecture
        if not cpu_layers.supports(a["hidden_size"], a["intermediate_size"], a["head_dim"], self.dtype, n):
            return None
        mods = self.__dict__.get("_table_modules")
        if mods is None:  # the modules (their weights are read each step: an edit or a new tensor shows)
            attn, mlp = self.layer.self_attn, self.layer.mlp
            mods = self.__dict__["_table_modules"] = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                                      mlp.up_proj, mlp.down_proj, self.layer.post_attention_layernorm)
        lins = mods[:7]
        # the weights as they are now (an edited or replaced weight is re-prepared: a new table)
        stamp = (id(run),) + tensors_stamp([m._parameters["weight"] for m in mods])
        cached = self.__dict__.get("_table")
        if cached is not None and cached[0] == stamp:
            return cached[1]
        attn, mlp = self.layer.self_attn, self.layer.mlp
        # the products' format as the step-by-step path takes them (int8 where the head's linears are)
        kinds = {run._takes(g, "avx512bf16") for g in (lins[:3], lins[3:4], lins[4:6], lins[6:7])}
        if len(kinds) > 1:
            return None
        key = kinds.pop()
        qkv, gu = run._entry(lins[:3], key), run._entry(lins[4:6], key)
        if qkv[2] is not None or any(m.bias is not None for m in (attn.o_proj, mlp.down_proj)):
            return None
        o, down = run._entry((attn.o_proj,), key)[0], run._entry((mlp.down_proj,), key)[0]
        table = cpu_layers.layer_table([{"ln1": None, "wqkv": qkv[0], "bqkv": None, "wo": o,
                                         "ln2": self.layer.post_attention_layernorm.weight, "w_gu": gu[0], "w_down": down}],
                                       q8=key == "q8")
        # the prepared tensors are kept with the table: its addresses stay theirs while it is used
        self.__dict__["_table"] = (stamp, table, (qkv[0], gu[0], o, down))
        return table

    @torch.inference_mode()
    def step_rows(self, input_ids: torch.Tensor, hidden: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor,
                  lengths: torch.Tensor, position_ids: torch.Tensor | None = None,
                  block: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`step` for several sequences of unequal length in one cache (the serving batch's
        drafting, :mod:`specfoundry.runtime.serving.drafts`): ``kv`` ``[2, slots, hkv, capacity, D]``,
        row ``rows[b]`` holds ``lengths[b]`` entries; its ``n`` new tokens are written after them.
        Default: causal among themselves at positions ``lengths[b] ..``; for a draft tree,
        ``position_ids`` ``[B, n]`` and ``block`` bool ``[B, n, k]`` over each row's last ``k``
        columns (the new tokens included), everything before them visible (as in :meth:`step`).
        Nothing is committed here: the caller keeps the lengths."""
        B, n = input_ids.shape
        dev = self.device
        a = self.architecture
        g = a["num_attention_heads"] // a["num_key_value_heads"]
        lengths = lengths.to(dev)
        offs = torch.arange(n, device=dev)
        write = lengths.view(B, 1) + offs  # [B, n]
        W = int(lengths.max()) + n
        if W > kv.shape[3]:
            raise ValueError(f"a row would exceed the drafting cache ({kv.shape[3]} entries)")
        if block is None:  # row b sees its committed entries and its new ones up to itself
            cols = torch.arange(W, device=dev)
            mask = (cols.view(1, 1, W) <= write.view(B, n, 1)).repeat(1, g, 1).unsqueeze(1)
        else:
            starts = lengths + n - block.shape[-1]
            if bool((starts < 0).any()):
                raise ValueError(f"block covers {block.shape[-1]} columns but a row has fewer")
            mask = row_mask(starts, block.to(dev), g)
        contiguous = bool((rows == torch.arange(rows[0], rows[0] + B, device=rows.device)).all())

        def attention(q, k, v):
            r = rows.view(B, 1).expand(B, n)
            kv[0][r, :, write] = k
            kv[1][r, :, write] = v
            if contiguous:  # a slice, not a gather
                keys, values = kv[0, rows[0]: rows[0] + B, :, :W], kv[1, rows[0]: rows[0] + B, :, :W]
            else:
                keys, values = kv[0, rows, :, :W], kv[1, rows, :, :W]
            return grouped_attention(q, keys, values, mask, self.layer.self_attn.scaling)

        return self._layer_step(input_ids, hidden, write if position_ids is None else position_ids.to(dev), attention)

    def _layer_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                    attention, rope=None) -> torch.Tensor:
        """The decoder layer over pairs ``(hidden, input_ids)`` ``[B, n]`` at ``position_ids``;
        ``attention(q, k, v)`` (RoPE applied, ``[B, n, heads, D]``) stores K/V wherever its cache
        keeps them and returns ``[B, n, hq*D]``: the one place :meth:`step`, :meth:`step_rows` and
        the CUDA-graphed drafting (:mod:`~specfoundry.runtime.cuda_graph_draft`) differ. ``rope``:
        ``positions -> (cos, sin)`` ``[B, n, 1, D]`` (default: the head's growing table, which reads
        the largest position on the host)."""
        B, n = input_ids.shape
        dev, dt = self.device, self.dtype
        hidden = hidden.to(dev, dt)
        layer, attn = self.layer, self.layer.self_attn
        a = self.architecture
        x, residual = self._step_inputs(input_ids.to(dev), hidden)
        lin = self._lin
        q, k, v = self._lins((attn.q_proj, attn.k_proj, attn.v_proj), x)
        q = q.reshape(B, n, a["num_attention_heads"], a["head_dim"])
        k = k.reshape(B, n, a["num_key_value_heads"], a["head_dim"])
        v = v.reshape(B, n, a["num_key_value_heads"], a["head_dim"])
        cos, sin = self._rope(position_ids.to(dev), hidden) if rope is None else rope(position_ids)
        o = attention(rotate(q, cos, sin), rotate(k, cos, sin), v)
        h = residual + lin(attn.o_proj, o)
        mlp, x = layer.mlp, self._norm(layer.post_attention_layernorm, h)
        gate, up = self._lins((mlp.gate_proj, mlp.up_proj), x)
        return h + lin(mlp.down_proj, mlp.act_fn(gate) * up)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens
        return emb(input_ids.to(emb.weight.device)).to(self.device, self.dtype)

    # -- construction --------------------------------------------------------------------
    @classmethod
    def build(cls, architecture: dict, target) -> "_EagleBase":
        """A head for ``target`` with freshly initialised (untrained) weights, in float32 on CPU;
        :func:`~.checkpoint.load_speculator` overwrites them."""
        raise NotImplementedError

    @classmethod
    def from_target(cls, target, seed: int | None = 0, **architecture) -> "_EagleBase":
        raise NotImplementedError


@contextlib.contextmanager
def seeded_init(seed: int | None):
    """Initialise under a fixed seed (None: fresh randomness) without disturbing the caller's
    global CPU RNG. Heads are built on CPU, so only the CPU generator matters."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield


class EagleHead(_EagleBase):
    """EAGLE-1 head (type ``"eagle"``): ``fc(cat(embed, feature))`` -> one decoder layer ->
    predicted final-normed feature; logits through the target's own ``lm_head``."""

    type = "eagle"
    ARCHITECTURE_SCHEMA = dict(LLAMA_LAYER_SCHEMA)

    def __init__(self, architecture: dict, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__(architecture, embed_tokens)
        H = self.architecture["hidden_size"]
        self._shared["lm_head"] = lm_head
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = Eagle1DecoderLayer(self.config)

    @classmethod
    def architecture_problems(cls, arch, target=None):
        out = super().architecture_problems(arch, target)
        if len(arch["feature_layers"]) != 1:
            out.append(("feature_layers", f"EAGLE-1 uses exactly one feature layer, got {arch['feature_layers']}"))
        elif target is not None and arch["feature_layers"][0] != target.num_layers:
            # the logits go through the target's lm_head with no norm: only index L fits
            out.append(("feature_layers", f"EAGLE-1 needs the final normed feature [{target.num_layers}], got {arch['feature_layers']}"))
        return out

    @classmethod
    def default_architecture(cls, target) -> dict:
        return {**layer_arch_from_target(target), "feature_layers": [int(target.num_layers)]}

    @property
    def lm_head(self) -> nn.Linear:
        return self._shared["lm_head"]

    def fuse_features(self, features):
        return features[:, :, 0].to(self.device, self.dtype)

    def _decode(self, input_ids, hidden, **kw):
        return self.layer(self._step_inputs(input_ids, hidden)[0], **kw)

    def _step_inputs(self, input_ids, hidden):
        x = self._lin(self.fc, torch.cat([self._embed(input_ids), hidden], dim=-1))
        return x, x  # the layer's input norm is the identity

    def compute_logits(self, hidden):
        # features at index L are already normed (what lm_head consumes): no final norm here
        w = self.lm_head.weight
        return self._lin(self.lm_head, hidden.to(w.device, w.dtype))

    @classmethod
    def build(cls, architecture, target):
        head = cls(architecture, target.embed_tokens, target.lm_head)
        head.target_identity = target.identity()
        return head

    @classmethod
    def from_target(cls, target, seed: int | None = 0, **architecture) -> "EagleHead":
        """A random-init (untrained) EAGLE-1 head for ``target``; ``architecture`` overrides the
        defaults (the target's layer shape, ``feature_layers=[L]``)."""
        arch = cls._resolve_architecture(target, architecture)
        with seeded_init(seed):
            head = cls.build(arch, target)
        return head.to(target.device, target.dtype)


class Eagle3Head(_EagleBase):
    """EAGLE-3 head (type ``"eagle3"``): normalised multi-layer feature fusion, a 2H-attention
    decoder layer, output norm and a reduced-vocabulary ``lm_head`` (``d2t``/``t2d`` buffers)."""

    type = "eagle3"
    ARCHITECTURE_SCHEMA = {**LLAMA_LAYER_SCHEMA, "draft_vocab_size": int}

    def __init__(self, architecture: dict, embed_tokens: nn.Embedding):
        super().__init__(architecture, embed_tokens)
        a = self.architecture
        H, F, Vd = a["hidden_size"], len(a["feature_layers"]), a["draft_vocab_size"]
        self.feature_norms = nn.ModuleList([LlamaRMSNorm(H, eps=a["rms_norm_eps"]) for _ in range(F)])
        self.fc = nn.Linear(F * H, H, bias=False)
        self.layer = Eagle3DecoderLayer(self.config)
        self.norm = LlamaRMSNorm(H, eps=a["rms_norm_eps"])
        self.lm_head = nn.Linear(H, Vd, bias=False)
        # persistent buffers: saved in the checkpoint, never cast by .to(dtype)
        self.register_buffer("d2t", torch.arange(Vd, dtype=torch.long))
        t2d = torch.zeros(a["vocab_size"], dtype=torch.bool)
        t2d[:Vd] = True
        self.register_buffer("t2d", t2d)

    @classmethod
    def architecture_problems(cls, arch, target=None):
        out = super().architecture_problems(arch, target)
        if not 1 <= arch["draft_vocab_size"] <= arch["vocab_size"]:
            out.append(("draft_vocab_size", f"must be in [1, vocab_size={arch['vocab_size']}], got {arch['draft_vocab_size']}"))
        return out

    @classmethod
    def tensor_problems(cls, tensors: dict, arch: dict | None) -> list[tuple[str, str]]:
        """Index integrity of a state dict: ``d2t`` distinct target ids in ``[0, vocab_size)``,
        ``t2d`` the mask of exactly those ids."""
        out = []
        d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
        V = (arch or {}).get("vocab_size", t2d.numel() if t2d is not None else None)
        if d2t is not None:
            if d2t.is_floating_point() or d2t.dtype == torch.bool:
                return [("d2t", f"must hold integer token ids, got dtype {d2t.dtype}")]
            if d2t.numel() and (int(d2t.min()) < 0 or (V is not None and int(d2t.max()) >= V)):
                return [("d2t", f"token ids must lie in [0, vocab_size={V}); found {int(d2t.min())}..{int(d2t.max())}")]
            if d2t.unique().numel() != d2t.numel():
                return [("d2t", "draft token ids must be distinct")]
            if t2d is not None:
                mask = torch.zeros(t2d.numel(), dtype=torch.bool)
                mask[d2t.long().view(-1)] = True
                if not torch.equal(t2d.view(-1).bool(), mask) or bool(((t2d != 0) & (t2d != 1)).any()):
                    out.append(("t2d", "does not mark exactly the target ids listed in d2t"))
        return out

    @classmethod
    def default_architecture(cls, target) -> dict:
        L = int(target.num_layers)
        # EAGLE-3's low/mid/high: inputs of layers 2, L//2 and L-3 (clamped for tiny targets)
        layers = [min(max(i, 0), L) for i in (2, L // 2, L - 3)]
        return {**layer_arch_from_target(target), "feature_layers": layers,
                "draft_vocab_size": int(min(32000, target.vocab_size))}

    @property
    def draft_vocab_size(self) -> int:
        return self.architecture["draft_vocab_size"]

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t

    def set_draft_vocab(self, token_ids) -> None:
        """Set the draft vocabulary: ``token_ids`` (target ids, distinct, ``draft_vocab_size`` of them)."""
        set_draft_vocab(self.d2t, self.t2d, token_ids, self.architecture["vocab_size"])

    def fuse_features(self, features):
        features = features.to(self.device, self.dtype)
        if features.shape[2] != len(self.feature_norms):
            raise ValueError(f"expected {len(self.feature_norms)} feature layers, got {features.shape[2]}")
        # normalise each layer first: raw target activations reach ~2.5e4
        if not torch.is_grad_enabled():  # drafting: all F norms in one C call where it runs
            w = torch.stack([norm.weight for norm in self.feature_norms])
            normed = cpu_layers.rms_norm(features, w, self.feature_norms[0].variance_epsilon)
            if normed is not None:
                return self._lin(self.fc, normed.flatten(-2))
        parts = [self._norm(norm, features[:, :, i]) for i, norm in enumerate(self.feature_norms)]
        return self._lin(self.fc, torch.cat(parts, dim=-1))

    def _decode(self, input_ids, hidden, **kw):
        return self.layer(hidden, input_embeds=self._embed(input_ids), **kw)

    def fused_draft(self, input_ids: torch.Tensor | None, features: torch.Tensor | None, hidden: torch.Tensor | None,
                    depth: int, cache: StaticKVCache, temperature: float = 0.0,
                    generator: torch.Generator | None = None, top_k: int = 0, budget: int = 0,
                    root: int | None = None, plan: tuple | None = None) -> tuple | None:
        """The drafter's queued committed pairs (next ``input_ids`` ``[1, n]``, raw target ``features``
        ``[1, n, F, H]``; None when nothing is queued) run on ``cache`` and committed, then a chain of
        ``depth`` drafts from the last output (or from ``hidden`` ``[1, H]``), in one C call
        (:func:`.cpu_layers.eagle3_draft`): what :meth:`fuse_features`, :meth:`step` and
        :meth:`compute_logits` compute, the same bits, without ~1 ms of Python per drafting step.
        Greedy (``temperature`` 0): the argmax per depth. Sampling: each draft drawn from
        ``softmax(logits / temperature)`` by one fp64 uniform from ``generator`` per depth (as
        :func:`~..sampling.sample` draws). ``top_k`` > 0 (greedy): EAGLE-2's tree of at most ``budget``
        nodes instead of a chain (the drafter's ``_grow_greedy``, the same drafts). Returns (target ids,
        the new root hidden ``[1, H]``, the draft distributions ``[depth, Vd]`` or None when greedy, the
        tree's parents (0 = root) or None for a chain; with the ``root`` id, the ids and parents as a
        :class:`~..tree.Draft`'s ``[1, 1 + nodes]`` rows, root first, the distributions ``[1 + depth, Vd]``
        with the root's (zero) row first, and a fifth entry: their host lists), or None where it does not run (not the AVX-512
        BF16 kernels, another dtype, more than ``cpu_layers.MAX_TOKENS`` queued pairs or ``top_k``,
        non-finite scaled logits): the caller takes the step-by-step path, with the cache and the
        generator as they were. ``plan``: :meth:`draft_plan` as the caller took it for this request
        (the weights as they were then), else it is taken now."""
        n = 0 if input_ids is None else input_ids.shape[1]
        if n > cpu_layers.MAX_TOKENS or (n == 0 and (depth == 0 or hidden is None)) or top_k > cpu_layers.MAX_TOKENS \
                or (n and (input_ids.shape[0] != 1 or features.dtype != torch.bfloat16 or features.device.type != "cpu")):
            return None
        if plan is None:
            plan = self.draft_plan(cache)
            if plan is None:
                return None
        table, w = plan
        cache.check_ready()
        steps = n + max(depth - 1, 0)  # positions: the queued pairs, every depth but the last
        cache.reserve(n + max(depth - 1, 0) * max(top_k, 1))  # a tree's steps write up to top_k entries
        past = cache.length
        cos, sin = self._rope.span(past, steps, w["onw"])
        a = self.architecture
        H = a["hidden_size"]
        uniforms = state = None
        if temperature > 0 and depth:
            state = generator.get_state() if generator is not None else torch.random.get_rng_state()
            uniforms = torch.rand(depth, generator=generator, dtype=torch.float64)
        out = cpu_layers.eagle3_draft(
            table, w, features.reshape(n, -1, H) if n else None, input_ids if n else None, hidden, depth, cache.kv,
            past, cos, sin, heads=(a["num_attention_heads"], a["num_key_value_heads"]),
            intermediate=a["intermediate_size"], eps=w["eps"], scale=self.layer.self_attn.scaling,
            temperature=temperature if depth else 0.0, uniforms=uniforms, top_k=top_k if depth else 0, budget=budget,
            root=root)
        if out is None:  # a draft row was not finite: nothing is kept, the uniforms go back
            if generator is not None:
                generator.set_state(state)
            else:
                torch.random.set_rng_state(state)
            return None
        tokens, h, q, parents, *host = out  # host: the draft's lists, with the root id
        if n:
            cache.mark_appended(n)
            cache.commit()
        return (tokens, h.view(1, H), q, parents, *host)

    def draft_plan(self, cache: StaticKVCache) -> tuple | None:
        """(the layer table, the weights) of :meth:`fused_draft` for drafting on ``cache``, or None
        where it does not run (not the AVX-512 BF16 kernels, not bf16 on CPU, norms of different
        epsilons). Made again when any tensor it reads was edited or replaced since the last call.
        A drafter takes it once per request (checking ~20 tensors cost ~0.06 ms of Python per
        drafting step on caches a forward just flushed; twenty-seventh session): weights edited
        during a request are not seen until the next one."""
        run = self.__dict__.get("_linears")
        if run is None or tuple(run.kernels[:2]) != ("avx512bf16", "avx512bf16") or not cache.kv.is_contiguous():
            return None
        mods = self.__dict__.get("_plan_modules")
        if mods is None:
            layer = self.layer
            attn, mlp = layer.self_attn, layer.mlp
            mods = self.__dict__["_plan_modules"] = (
                attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, self.fc,
                self.lm_head, *self.feature_norms, layer.input_layernorm, layer.hidden_norm,
                layer.post_attention_layernorm, self.norm, self.embed_tokens)
        params = [m._parameters for m in mods]
        tensors = [p["weight"] for p in params] + [b for p in params if (b := p.get("bias")) is not None]
        tensors.append(self._buffers["d2t"])
        stamp = (id(run), self.dtype) + tensors_stamp(tensors) + tuple(m.variance_epsilon for m in mods[9:-1])
        cached = self.__dict__.get("_plan")
        if cached is not None and cached[0] == stamp:
            return cached[1]
        table = self._layer_table(1, 1, None, cache)
        w = None if table is None else self._draft_weights(run)
        plan = None if w is None else (table, w)
        self.__dict__["_plan"] = (stamp, plan)
        return plan

    def _draft_weights(self, run: PreparedLinears) -> dict | None:
        """:meth:`fused_draft`'s weights (see :func:`.cpu_layers.eagle3_draft`), kept while they are
        unchanged; None when they do not fit it (not bf16 on CPU, norms of different epsilons)."""
        layer = self.layer
        norms = self.__dict__.get("_draft_norms")
        if norms is None:
            norms = self.__dict__["_draft_norms"] = (*self.feature_norms, layer.input_layernorm, layer.hidden_norm,
                                                     layer.post_attention_layernorm, self.norm)
        emb = self.embed_tokens._parameters["weight"]
        tensors = [m._parameters["weight"] for m in norms] + [emb, self._buffers["d2t"]]
        stamp = (id(run),) + tensors_stamp(tensors) + tuple(m.variance_epsilon for m in norms)
        cached = self.__dict__.get("_draft_w")
        if cached is not None and cached[0] == stamp:
            w = cached[1]
        else:
            if len({m.variance_epsilon for m in norms}) != 1 or any(t.device.type != "cpu" for t in tensors) \
                    or any(t.dtype != torch.bfloat16 for t in tensors[:-1]) or not emb.is_contiguous():
                w = None
            else:
                w = {"fnw": torch.stack([m.weight.detach() for m in self.feature_norms]), "inw": layer.input_layernorm.weight,
                     "hnw": layer.hidden_norm.weight, "onw": self.norm.weight, "emb": emb, "eps": norms[0].variance_epsilon,
                     "d2t": self.d2t.contiguous()}
                w = {k: v.detach().contiguous() if isinstance(v, torch.Tensor) else v for k, v in w.items()}
            self.__dict__["_draft_w"] = (stamp, w)
        if w is None:
            return None
        # the products' prepared weights: remade by PreparedLinears when edited
        fcw, lmw = (run._entry((m,), run._takes((m,), "avx512bf16"))[0] for m in (self.fc, self.lm_head))
        return {**w, "fcw": fcw, "lmw": lmw} if fcw.dtype == lmw.dtype in (torch.bfloat16, torch.uint8) else None

    def _step_inputs(self, input_ids, hidden):
        layer = self.layer
        return torch.cat([self._norm(layer.input_layernorm, self._embed(input_ids)), self._norm(layer.hidden_norm, hidden)],
                         dim=-1), hidden

    def compute_logits(self, hidden):
        return self._lin(self.lm_head, self._norm(self.norm, hidden.to(self.device, self.dtype)))

    @classmethod
    def build(cls, architecture, target):
        head = cls(architecture, target.embed_tokens)
        head.target_identity = target.identity()
        return head

    @classmethod
    def from_target(cls, target, seed: int | None = 0, draft_token_ids=None, **architecture) -> "Eagle3Head":
        """A random-init (untrained) EAGLE-3 head for ``target``.

        ``draft_token_ids`` picks the draft vocabulary (default: the first ``draft_vocab_size``
        target ids); the head's ``lm_head`` rows and output norm are copied from the target's so
        an untrained head already ranks tokens sensibly from a target-like hidden state.
        """
        if draft_token_ids is not None and "draft_vocab_size" not in architecture:
            architecture = {**architecture, "draft_vocab_size": len(draft_token_ids)}
        arch = cls._resolve_architecture(target, architecture)
        with seeded_init(seed):
            head = cls.build(arch, target)
        head = head.to(target.device, target.dtype)  # copy the target rows at full precision
        if draft_token_ids is not None:
            head.set_draft_vocab(draft_token_ids)
        with torch.no_grad():
            w = target.lm_head.weight.detach()
            head.lm_head.weight.copy_(w[head.d2t.to(w.device)])
            head.norm.weight.copy_(target.final_norm.weight.detach())
        return head
