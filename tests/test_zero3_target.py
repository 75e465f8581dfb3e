"""train/zero3_target.py on CPU: 2 processes (torchrun, gloo) load the smoke run's tiny Llama-shaped
target partitioned by ZeRO-3; each must hold half of every parameter but the LM head, report the
whole load's fingerprint and identity, and give bit-identical hidden states (through the training
run's hidden-state source) to a whole load, in fp32 and bf16. ~15 s each."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from specfoundry.train.recipe import load_recipe, resolve
from specfoundry.train.smoke import smoke_overrides

SCRIPT = textwrap.dedent('''
    import gc, json, os, sys, weakref, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    from specfoundry.runtime import load_target
    from specfoundry.train.features import HiddenStateSource
    from specfoundry.train.recipe import load_recipe, resolve
    from specfoundry.train.zero3_target import PartitionedTarget, is_zero3_placement, load_partitioned_target, release

    r = resolve(load_recipe("eagle-llama3-70b", overrides=json.loads(sys.argv[1])))
    assert is_zero3_placement(r)
    t = load_partitioned_target(r, "cpu")
    w = load_target(r.target.name, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[r.target.dtype], backend="hf")
    assert t.dtype == w.dtype
    assert isinstance(t, PartitionedTarget)
    rows = [{"id": i, "input_ids": list(range(3 + i, 20 + 2 * i)), "loss_mask": [True] * (17 + i)} for i in range(3)]
    feats = {}
    for name, tgt in (("part", t), ("whole", w)):
        src = HiddenStateSource("online", tgt, (2, 4, 8))
        feats[name] = [src.compute(r["input_ids"]) for r in rows]
    same = all(bool((a[0] == b[0]).all()) and bool((a[1] == b[1]).all()) for a, b in zip(feats["part"], feats["whole"]))
    out = {"rank": dist.get_rank(), "partition": t.partition, "fingerprint": t.fingerprint(),
           "whole_fingerprint": w.fingerprint(), "identity": t.identity(), "whole_identity": w.identity(),
           "same_hidden": same, "lm_head_same": bool((t.lm_head.weight == w.lm_head.weight).all()),
           "embed_same": bool((t.embed_tokens.weight == w.embed_tokens.weight).all()),
           "whole_params": sum(p.numel() for p in w.model.parameters()), "lm_head": w.lm_head.weight.numel()}
    part_ref = weakref.ref(next(t.model.model.layers[0].parameters()).ds_tensor)
    del feats, src
    out["released"] = release(t)
    gc.collect()
    out["partition_freed"] = part_ref() is None
    with open(os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
''')


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_partitioned_target_holds_half_per_rank_and_matches_a_whole_load(tmp_path, dtype):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    overrides = dict(kv.split("=", 1) for kv in smoke_overrides("eagle-llama3-70b"))
    overrides = {k: (json.loads(v) if v[:1] in "[{" or v in ("null", "true", "false") or v.lstrip("-").isdigit()
                     else v) for k, v in overrides.items()}
    overrides["target.dtype"] = dtype  # bf16: zero.Init builds the partitions in the target's dtype
    assert resolve(load_recipe("eagle-llama3-70b", overrides=overrides)).target.placement == "zero3"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "probe.log"
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall a rank
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_addr", "127.0.0.1", "--master_port", str(port), str(script),
                                 json.dumps(overrides), str(tmp_path)], env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:  # a hang: end the whole process group (torchrun and its ranks)
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-4000:]
    outs = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    for o in outs:
        p = o["partition"]
        # every parameter but the LM head is partitioned, half of its elements on each rank
        assert p["world"] == 2 and p["partitioned_elements"] == o["whole_params"] - o["lm_head"]
        assert p["fraction_this_rank"] == pytest.approx(0.5, abs=0.01)
        # whole copies beside the partitions: the LM head (in the model) and the embedding
        assert p["whole_copy_elements"] == 2 * o["lm_head"]
        # what this rank holds of the target, against the whole target
        size = {"fp32": 4, "bf16": 2}[dtype]
        assert p["bytes_this_rank"] == size * (p["elements_this_rank"] + p["whole_copy_elements"])
        assert p["whole_target_bytes"] == size * o["whole_params"]
        assert o["fingerprint"] == o["whole_fingerprint"] and o["identity"] == o["whole_identity"]
        assert o["same_hidden"] and o["lm_head_same"] and o["embed_same"]
        assert o["released"] and o["partition_freed"]  # release() really frees the partitions
    assert outs[0]["partition"]["elements_this_rank"] + outs[1]["partition"]["elements_this_rank"] \
        >= outs[0]["partition"]["partitioned_elements"]
