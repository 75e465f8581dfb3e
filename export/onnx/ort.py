"""onnxruntime-backed stand-ins for the runtime's target and speculators.

Scope: run exported graphs (:mod:`.graphs`) behind the interfaces the runtime already uses, so
the runtime's own generator, verifier and drafters (tree search included) drive them unchanged:

- :class:`OrtTarget`: what :class:`~specfoundry.runtime.generator.SpeculativeGenerator` needs
  from a target (``forward`` with a :class:`~specfoundry.runtime.target.KVCache`, facts,
  tokenizer helpers).
- :class:`OrtEagleHead` + :class:`OrtEagleDrafter`: the EAGLE/EAGLE-3 step and fusion graphs
  behind the head interface the runtime's ``EagleDrafter`` calls.
- :class:`OrtMedusaHeads`: the Medusa graph behind ``MedusaHeads`` for the runtime's
  ``MedusaDrafter``.

KV entries live in the runtime's ``KVCache`` as torch tensors (so its commit/rollback/crop
bookkeeping applies as-is); every call feeds the committed entries as ``past_key_values`` and
appends the new ones from ``present``. CPU only (onnxruntime's CPU provider by default);
float32/float16 graphs (numpy has no bfloat16).
"""

from __future__ import annotations

import numpy as np
import torch

from specfoundry.runtime.drafters.eagle import EagleDrafter
from specfoundry.runtime.drafters.medusa import MedusaDrafter
from specfoundry.runtime.speculators import MedusaHeads
from specfoundry.runtime.target import ChatTokenizerMixin, KVCache, TargetOutput

from .graphs import fuse_path, read_metadata
from .tree_mask import pack_tree_mask

__all__ = ["make_session", "OrtTarget", "OrtEagleHead", "OrtEagleDrafter", "OrtMedusaHeads", "load_ort_drafter"]

_NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def make_session(path, threads: int | None = None, providers=None):
    """An onnxruntime session for ``path`` (``threads``: intra-op threads, None = ORT default)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=providers or ["CPUExecutionProvider"])


def _np_dtype(meta: dict):
    try:
        return _NP_DTYPES[meta["dtype"]]
    except KeyError:
        raise ValueError(f"onnxruntime wrappers run float32/float16 graphs, this one is {meta['dtype']}") from None


def _np(x: torch.Tensor, dtype=None) -> np.ndarray:
    a = x.detach().cpu().numpy()
    return np.ascontiguousarray(a if dtype is None else a.astype(dtype, copy=False))


def _mask_feed(meta: dict, allowed_new: torch.Tensor) -> np.ndarray:
    """Bool new-token mask ``[B, T, T]`` -> the graph's ``tree_mask`` encoding."""
    if meta["variant"] == "plugin":
        return _np(pack_tree_mask(allowed_new.to(torch.bool)))
    return _np(allowed_new.to(torch.bool))


def _past(cache: KVCache | None, layer: int, B: int, Hkv: int, D: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    layers = cache.hf.layers if cache is not None else []
    if layer < len(layers) and layers[layer].keys is not None and layers[layer].keys.numel():
        return _np(layers[layer].keys, dtype), _np(layers[layer].values, dtype)
    empty = np.zeros((B, Hkv, 0, D), dtype=dtype)
    return empty, empty


def _positions(position_ids, past: int, B: int, n: int) -> torch.Tensor:
    if position_ids is None:
        return (past + torch.arange(n)).expand(B, n)
    return position_ids.to("cpu", torch.long).expand(B, n)


class OrtTarget(ChatTokenizerMixin):
    """An exported target graph run by onnxruntime, with :class:`TargetModel`'s forward contract.

    ``tokenizer``/``eos_token_ids``/``name`` are not in the graph: pass them, or use
    :meth:`like` to copy them from the PyTorch target the graph came from.
    """

    def __init__(self, path, *, tokenizer=None, eos_token_ids=(), name: str | None = None, threads: int | None = None,
                 providers=None):
        self.path = str(path)
        self.meta = read_metadata(path)
        if self.meta.get("kind") != "target":
            raise ValueError(f"{path}: a {self.meta.get('kind')!r} graph, not a target")
        self.session = make_session(path, threads, providers)
        self.tokenizer = tokenizer
        self._eos = set(int(i) for i in eos_token_ids)
        self.name = name or (self.meta.get("target") or {}).get("name", "onnx-target")
        self._np_dtype = _np_dtype(self.meta)
        self._outputs = [o.name for o in self.session.get_outputs()]

    @classmethod
    def like(cls, path, target, **kwargs) -> "OrtTarget":
        """Graph ``path`` with the tokenizer, EOS ids and name of PyTorch ``target``."""
        return cls(path, tokenizer=target.tokenizer, eos_token_ids=target.eos_token_ids, name=target.name, **kwargs)

    # -- facts (as TargetModel) ----------------------------------------------------------
    device = torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.meta["dtype"])

    @property
    def variant(self) -> str:
        return self.meta["variant"]

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.meta["hidden_size"]

    @property
    def num_layers(self) -> int:
        return self.meta["num_layers"]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The hidden-state layers the graph outputs (a forward may ask for any subset)."""
        return tuple(self.meta["feature_layers"])

    @property
    def eos_token_ids(self) -> set[int]:
        ids = set(self._eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def new_cache(self, batch: int = 1, capacity: int | None = None) -> KVCache:
        return KVCache()

    # -- the forward ---------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: KVCache, position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                logits_for: torch.Tensor | None = None) -> TargetOutput:
        """Same contract as :meth:`TargetModel.forward` (new KV entries left pending in ``cache``)."""
        cache.check_ready()
        missing = [i for i in feature_layers if i not in self.feature_layers]
        if missing:
            raise ValueError(f"feature layers {missing} were not exported (graph has {list(self.feature_layers)})")
        input_ids = input_ids.to("cpu", torch.long)
        B, n = input_ids.shape
        past = cache.length
        m = self.meta
        if tree_mask is None:
            tree_mask = torch.ones(n, n, dtype=torch.bool).tril().expand(B, n, n)
        feeds = {"input_ids": _np(input_ids), "position_ids": _np(_positions(position_ids, past, B, n)),
                 "tree_mask": _mask_feed(m, tree_mask.to("cpu").expand(B, n, n))}
        for i in range(m["num_layers"]):
            k, v = _past(cache, i, B, m["num_kv_heads"], m["head_dim"], self._np_dtype)
            feeds[f"past_key_values.{i}.key"], feeds[f"past_key_values.{i}.value"] = k, v
        out = dict(zip(self._outputs, self.session.run(None, feeds)))
        for i in range(m["num_layers"]):
            k = torch.from_numpy(out[f"present.{i}.key"][:, :, past:])
            v = torch.from_numpy(out[f"present.{i}.value"][:, :, past:])
            cache.hf.update(k, v, i)
        cache.mark_appended(n)
        logits = torch.from_numpy(out["logits"])
        if logits_for is not None:
            logits = logits[:, logits_for.to("cpu")]
        feats = None
        if feature_layers:
            idx = torch.tensor([self.feature_layers.index(i) for i in feature_layers])
            feats = torch.from_numpy(out["hidden_states"]).index_select(2, idx)
        return TargetOutput(logits=logits, features=feats)


class OrtEagleHead:
    """An exported EAGLE/EAGLE-3 step graph (+ its fusion graph) with the head interface
    :class:`~specfoundry.runtime.drafters.eagle.EagleDrafter` uses: ``__call__`` (the head's
    ``forward``), ``fuse_features``, ``compute_logits`` and the vocabulary/feature facts.

    The graph's contract lets new tokens see *all* past entries, while the drafter's tree search
    keeps sibling draft entries in the cache that a node must not see. Such calls run one batch
    row per new token, each with its own visible past gathered (``[committed, ancestors]``), and
    so stay inside the contract (and inside what the TreeAttention plugin supports).

    The step graph returns the draft logits together with the hidden state (one engine call);
    ``compute_logits(h)`` looks ``h``'s rows up among the latest outputs (exact match) instead of
    running a second graph. It raises for rows it has not produced.
    """

    def __init__(self, path, fuse: str | None = None, *, threads: int | None = None, providers=None):
        self.path = str(path)
        self.meta = read_metadata(path)
        if self.meta.get("kind") not in ("eagle", "eagle3"):
            raise ValueError(f"{path}: a {self.meta.get('kind')!r} graph, not an EAGLE head step")
        self.session = make_session(path, threads, providers)
        self.fuse_session = make_session(fuse or fuse_path(path), threads, providers)
        self.architecture = dict(self.meta["architecture"])
        self.type = self.meta["kind"]
        self._np_dtype = _np_dtype(self.meta)
        self._outputs = [o.name for o in self.session.get_outputs()]
        d2t = self.meta.get("d2t")
        self._d2t = None if d2t is None else torch.tensor(d2t, dtype=torch.long)
        self._memo: list[tuple[torch.Tensor, torch.Tensor]] = []  # recent (hidden rows, logits rows)

    # -- facts (as the torch heads) --------------------------------------------------------
    device = torch.device("cpu")

    def eval(self):
        return self

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.meta["dtype"])

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.meta["feature_layers"])

    @property
    def hidden_size(self) -> int:
        return self.meta["hidden_size"]

    @property
    def draft_vocab_size(self) -> int:
        return self.meta["draft_vocab_size"]

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        return self._d2t

    # -- graph calls -----------------------------------------------------------------------
    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        (h,) = self.fuse_session.run(None, {"features": _np(features, self._np_dtype)})
        return torch.from_numpy(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        for h_rows, l_rows in reversed(self._memo):
            eq = (rows[:, None, :] == h_rows[None, :, :]).all(-1)  # [m, M]
            if bool(eq.any(1).all()):
                return l_rows[eq.float().argmax(1)].reshape(*hidden.shape[:-1], -1)
        raise RuntimeError("compute_logits: these hidden rows were not produced by the latest step graph calls")

    def __call__(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """As ``_EagleBase.forward``: ``attention_mask`` None (causal) or bool ``[B, n, past + n]``."""
        if cache is not None:
            cache.check_ready()
        input_ids = input_ids.to("cpu", torch.long)
        B, n = input_ids.shape
        past = cache.length if cache is not None else 0
        pos = _positions(position_ids, past, B, n)
        if attention_mask is None:
            attention_mask = torch.ones(n, past + n, dtype=torch.bool).tril(past).expand(B, n, past + n)
        if attention_mask.dtype != torch.bool:
            raise ValueError("OrtEagleHead takes a bool attention mask (True = may attend)")
        mask = attention_mask.to("cpu")
        m = self.meta
        pk, pv = _past(cache, 0, B, m["num_kv_heads"], m["head_dim"], self._np_dtype)
        hidden = hidden.to("cpu")
        if bool(mask[:, :, :past].all()):
            h, logits, nk, nv = self._run(input_ids, hidden, pos, mask[:, :, past:], pk, pv)
            new_k, new_v = nk[:, :, past:], nv[:, :, past:]
        else:
            h, logits, new_k, new_v = self._run_rows(input_ids, hidden, pos, mask, pk, pv, past)
        if cache is not None:
            cache.hf.update(torch.from_numpy(np.ascontiguousarray(new_k)), torch.from_numpy(np.ascontiguousarray(new_v)), 0)
            cache.mark_appended(n)
        h, logits = torch.from_numpy(h), torch.from_numpy(logits)
        self._memo = (self._memo + [(h.reshape(-1, h.shape[-1]), logits.reshape(-1, logits.shape[-1]))])[-2:]
        return h

    def _run(self, ids, hidden, pos, new_mask, pk, pv):
        feeds = {"input_ids": _np(ids), "hidden": _np(hidden, self._np_dtype), "position_ids": _np(pos),
                 "tree_mask": _mask_feed(self.meta, new_mask), "past_key_values.0.key": pk,
                 "past_key_values.0.value": pv}
        out = dict(zip(self._outputs, self.session.run(None, feeds)))
        return out["hidden_out"], out["logits"], out["present.0.key"], out["present.0.value"]

    def _run_rows(self, ids, hidden, pos, mask, pk, pv, past):
        """One batch row per new token, with the past entries its mask row allows."""
        B, n = ids.shape
        new = mask[:, :, past:]
        if not bool((new == torch.eye(n, dtype=torch.bool)).all()):
            raise NotImplementedError("new tokens that see only part of the past must see no other new token")
        vis = mask[:, :, :past]
        counts = vis.sum(-1)  # [B, n]
        H = hidden.shape[-1]
        h_out = np.zeros((B, n, H), dtype=self._np_dtype)
        logits = None
        Hkv, D = pk.shape[1], pk.shape[3]
        new_k = np.zeros((B, Hkv, n, D), dtype=self._np_dtype)
        new_v = np.zeros_like(new_k)
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        for c in counts.unique().tolist():  # rows with equal visible-past counts share one call
            bs, ts = (counts == c).nonzero(as_tuple=True)
            r = bs.shape[0]
            sel = torch.stack([vis[b, t].nonzero().view(-1) for b, t in zip(bs.tolist(), ts.tolist())])  # [r, c]
            gk = np.stack([pk[b][:, s] for b, s in zip(bs.tolist(), sel.numpy())])  # [r, Hkv, c, D]
            gv = np.stack([pv[b][:, s] for b, s in zip(bs.tolist(), sel.numpy())])
            h, lg, k, v = self._run(ids[bs, ts].view(r, 1), hidden[bs, ts].view(r, 1, H), pos[bs, ts].view(r, 1),
                                    one.expand(r, 1, 1), gk, gv)
            if logits is None:
                logits = np.zeros((B, n, lg.shape[-1]), dtype=lg.dtype)
            b_np, t_np = bs.numpy(), ts.numpy()
            h_out[b_np, t_np] = h[:, 0]
            logits[b_np, t_np] = lg[:, 0]
            new_k[b_np, :, t_np] = k[:, :, -1]
            new_v[b_np, :, t_np] = v[:, :, -1]
        return h_out, logits, new_k, new_v


class OrtEagleDrafter(EagleDrafter):
    """The runtime's EAGLE drafter (same tree search, same options) over an :class:`OrtEagleHead`."""

    type = "eagle-onnx"
    head_class = OrtEagleHead


class OrtMedusaHeads(MedusaHeads):
    """An exported Medusa graph behind the ``MedusaHeads`` interface (so the runtime's
    ``MedusaDrafter`` accepts it). ``MedusaHeads.__init__`` is skipped on purpose: it would
    allocate the heads' weights, which live in the graph."""

    def __init__(self, path, *, threads: int | None = None, providers=None):
        torch.nn.Module.__init__(self)
        self.path = str(path)
        self.meta = read_metadata(path)
        if self.meta.get("kind") != "medusa":
            raise ValueError(f"{path}: a {self.meta.get('kind')!r} graph, not Medusa heads")
        self.session = make_session(path, threads, providers)
        self.architecture = dict(self.meta["architecture"])
        self.target_identity = self.meta.get("target")
        # the exported static tree (graphs written before it was recorded: the default tree)
        self.drafter_options = {"choices": self.meta["choices"]} if self.meta.get("choices") else {}
        if self.drafter_options:
            from specfoundry.runtime.adaptive import MAX_DRAFT_NODES
            from specfoundry.runtime.speculators.checkpoint import choices_problem

            problem = choices_problem(self.meta["choices"], MAX_DRAFT_NODES - 1, self.architecture["num_heads"])
            if problem:
                raise ValueError(f"{path}: the graph's static tree (choices): {problem}")
        self._np_dtype = _np_dtype(self.meta)
        d2t = self.meta.get("d2t")  # reduced-vocabulary heads: draft id -> target id
        self._d2t = None if d2t is None else torch.tensor(d2t, dtype=torch.long)
        Vd = self.architecture.get("draft_vocab_size", self.architecture["vocab_size"])
        if (Vd < self.architecture["vocab_size"]) != (self._d2t is not None) or (
                self._d2t is not None and MedusaHeads.tensor_problems({"d2t": self._d2t}, self.architecture)) or (
                self._d2t is not None and self._d2t.numel() != Vd):
            raise ValueError(f"{path}: the draft vocabulary map (d2t) does not fit draft_vocab_size {Vd}")

    @property
    def draft_to_target(self):
        return self._d2t

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.meta["dtype"])

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[..., H]`` -> logits ``[..., K, V]``."""
        flat = hidden.reshape(-1, 1, hidden.shape[-1])
        (logits,) = self.session.run(None, {"hidden": _np(flat, self._np_dtype)})
        return torch.from_numpy(logits).reshape(*hidden.shape[:-1], *logits.shape[-2:])


def load_ort_drafter(path, *, threads: int | None = None, **options):
    """A runtime drafter over an exported speculator graph (EAGLE/EAGLE-3 or Medusa);
    ``options`` go to the drafter (``tree``, ``depth``, ``top_k``, ``total_tokens`` / ``choices``)."""
    kind = read_metadata(path).get("kind")
    if kind in ("eagle", "eagle3"):
        return OrtEagleDrafter(OrtEagleHead(path, threads=threads), **options)
    if kind == "medusa":
        return MedusaDrafter(OrtMedusaHeads(path, threads=threads), **options)
    raise ValueError(f"{path}: no ONNX drafter for graph kind {kind!r}")
