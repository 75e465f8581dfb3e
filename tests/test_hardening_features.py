"""Hardening of the offline hidden-state store (issue 16): a corrupt manifest or a truncated or
tampered shard is computed again (it is a cache), never read as training data."""

import json

import pytest
import torch
from datasets import Dataset

from specfoundry.train.features import HiddenStateSource

pytestmark = pytest.mark.usefixtures("single_thread")


def _dataset(n=6):
    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": [], "loss_mask": []}
    for i in range(n):
        L = 5 + i
        rows["input_ids"].append(torch.randint(0, 64, (L,), generator=g).tolist())
        rows["loss_mask"].append([1] * L)
    return Dataset.from_dict(rows)


def _batches(src, ds):
    return list(src.batches(ds, 2, seed=0, epoch=0, shuffle=False))


def _same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("damage", ["manifest-not-json", "manifest-list", "truncated-shard", "offsets", "lengths"])
def test_a_damaged_feature_store_is_computed_again(tiny_target, tmp_path, damage):
    ds = _dataset()
    cache = tmp_path / "hs"
    src = HiddenStateSource("offline", tiny_target, (1, 2), cache_dir=cache, shard_tokens=20)
    src.prepare(ds, progress=False)
    want = _batches(src, ds)
    manifest_file = cache / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    if damage == "manifest-not-json":
        manifest_file.write_text("{not json")
    elif damage == "manifest-list":
        manifest_file.write_text("[]")
    elif damage == "truncated-shard":
        f = cache / manifest["shards"]["0"]["file"]
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "offsets":
        manifest["shards"]["0"]["offsets"] = [o + 3 for o in manifest["shards"]["0"]["offsets"]]
        manifest_file.write_text(json.dumps(manifest))
    else:
        manifest["shards"]["0"]["lengths"][0] += 50
        manifest_file.write_text(json.dumps(manifest))
    again = HiddenStateSource("offline", tiny_target, (1, 2), cache_dir=cache, shard_tokens=20)
    if damage.startswith("manifest"):
        with pytest.warns(RuntimeWarning, match="corrupt hidden-state manifest"):
            again.prepare(ds, progress=False)
    else:
        again.prepare(ds, progress=False)
    _same(_batches(again, ds), want)
