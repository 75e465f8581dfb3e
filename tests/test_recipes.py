"""Recipes: the strict schema, the shipped recipes and launcher configs, and the dry-run plan.

Everything here is pure Python over YAML/JSON files: no model, no network, no torch needed.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from specfoundry.train import presets
from specfoundry.train.plan import format_plan, make_plan
from specfoundry.train.recipe import (METHODS, RESOLVED_FILENAME, RecipeError, accelerate_config_path,
                                      deepspeed_config_for, deepspeed_config_path, dump_resolved, launch_args,
                                      list_launcher_configs, list_recipes, load_recipe, prompt_source_dicts,
                                      read_deepspeed_config, recipe_from_dict, recipe_path, resolve)

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"eagle3-smollm2-135m", "eagle3-smollm2-135m-long", "medusa1-smollm2-135m", "medusa2-smollm2-135m",
            "eagle1-smollm2-135m", "draft-smollm2-135m", "eagle-llama3-70b", "eagle3-llama3-8b",
            "medusa2-llama3-8b", "draft-llama3-70b"}
GPU_RECIPES = ["eagle-llama3-70b", "eagle3-llama3-8b", "medusa2-llama3-8b", "draft-llama3-70b"]
GB = 1e9


def _write(tmp_path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


MINIMAL = """\
method: eagle3
training:
  max_steps: 10
"""


# ---------------------------------------------------------------------------- shipped files

def test_required_recipes_and_launchers_are_shipped():
    assert REQUIRED <= set(list_recipes())
    cfgs = list_launcher_configs()
    assert {"single-cpu", "ddp-2proc", "zero2", "zero3", "multinode-example"} <= set(cfgs["accelerate"])
    assert {"zero2", "zero3"} <= set(cfgs["deepspeed"])


@pytest.mark.parametrize("name", list_recipes())
def test_shipped_recipe_validates(name):
    r = load_recipe(name)
    assert r.name == name and r.method in METHODS
    assert Path(r.source) == recipe_path(name)
    # the plain dict form validates back to the same recipe
    assert recipe_from_dict(r.to_dict(), source="<roundtrip>") == r


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_file_starts_with_its_command(name):
    first = recipe_path(name).read_text().splitlines()[0]
    assert first == f"# make train RECIPE={name}"


def test_packaged_yaml_is_found_through_importlib_resources():
    # names resolve through the installed package, not the working directory
    cwd = os.getcwd()
    try:
        os.chdir("/")
        assert load_recipe("eagle3-smollm2-135m").method == "eagle3"
    finally:
        os.chdir(cwd)


@pytest.mark.parametrize("name", list_launcher_configs()["accelerate"])
def test_accelerate_configs_load_with_accelerate(name):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(accelerate_config_path(name)))  # rejects unknown keys
    raw = yaml.safe_load(accelerate_config_path(name).read_text())
    if raw["distributed_type"] == "DEEPSPEED":
        ds = raw["deepspeed_config"]
        # with a deepspeed_config_file accelerate refuses duplicated settings in its own YAML
        assert set(ds) <= {"deepspeed_config_file", "zero3_init_flag", "deepspeed_multinode_launcher"}
        assert (ROOT / ds["deepspeed_config_file"]).is_file()
    assert cfg.num_processes >= 1


@pytest.mark.parametrize("name", list_launcher_configs()["deepspeed"])
def test_deepspeed_configs_use_auto_values(name):
    cfg = read_deepspeed_config(name)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping"):
        assert cfg[key] == "auto", key
    assert cfg["bf16"]["enabled"] == "auto" and cfg["fp16"]["enabled"] == "auto"
    assert cfg["zero_optimization"]["stage"] == int(name[4])  # zero2 / zero3 / zero3-offload


@pytest.mark.parametrize("name", list_launcher_configs()["deepspeed"])
def test_deepspeed_configs_pass_deepspeed_validation(name):
    pytest.importorskip("deepspeed", reason="deepspeed (the [train] extra) is not installed")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = read_deepspeed_config(name)

    def filled(d):  # accelerate replaces "auto" before DeepSpeed sees the config
        return {k: (True if k == "enabled" else 1000) if v == "auto" else v for k, v in d.items()}

    assert DeepSpeedZeroConfig(**filled(cfg["zero_optimization"])).stage == cfg["zero_optimization"]["stage"]
    DeepSpeedBF16Config(**filled(cfg["bf16"]))
    DeepSpeedFP16Config(**filled(cfg["fp16"]))


@pytest.mark.parametrize("name", [n for n in list_recipes() if load_recipe(n).launcher.deepspeed])
def test_deepspeed_config_for_fills_every_auto_from_the_recipe(name):
    r = load_recipe(name)
    cfg = deepspeed_config_for(r)
    assert "auto" not in json.dumps(cfg)
    tr = r.training
    assert cfg["gradient_clipping"] == tr.grad_clip  # accelerate alone would put 1.0 here
    assert cfg["train_batch_size"] == tr.batch_size * tr.grad_accum * r.launcher.num_processes
    assert cfg["bf16"]["enabled"] is (tr.precision == "bf16") and cfg["fp16"]["enabled"] is False
    H = presets.resolve_architecture(r.target.name).hidden_size
    assert cfg["zero_optimization"]["reduce_bucket_size"] == H * H
    assert deepspeed_config_for(load_recipe("eagle3-smollm2-135m")) is None


# ---------------------------------------------------------------------------- strict schema

def test_typo_is_one_clear_error_with_a_suggestion(tmp_path):
    p = _write(tmp_path, MINIMAL + "  learning_rat: 1.0e-3\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert str(p) in msg
    assert "unknown key 'learning_rat' in training; did you mean 'learning_rate'?" in msg
    assert e.value.problems == [("training.learning_rat", e.value.problems[0][1])]


def test_nested_typo_names_the_key_path(tmp_path):
    p = _write(tmp_path, MINIMAL + "data:\n  prompts:\n    - {source: magpie, cont: 10}\n")
    with pytest.raises(RecipeError, match=r"unknown key 'cont' in data\.prompts\[0\] \(source magpie\); "
                                          r"did you mean 'count'\?"):
        load_recipe(p)


@pytest.mark.parametrize("line, expected", [
    ("  batch_size: eight", "training.batch_size: expected an integer, got str 'eight'"),
    ("  batch_size: true", "training.batch_size: expected an integer, got bool True"),
    ("  batch_size: 2.5", "training.batch_size: expected an integer, got float 2.5"),
    ("  learning_rate: fast", "training.learning_rate: expected a number, got str 'fast'"),
    ("  learning_rate: 0", "training.learning_rate: must be > 0, got 0.0"),
    ("  gradient_checkpointing: 'yes'", "training.gradient_checkpointing: expected true or false, got str 'yes'"),
    ("  scheduler: cosin", "training.scheduler: 'cosin' is not one of cosine, linear, constant; did you mean 'cosine'?"),
    ("  precision: int8", "training.precision: 'int8' is not one of auto, fp32, bf16, fp16"),
])
def test_wrong_type_or_value_fails_clearly(tmp_path, line, expected):
    p = _write(tmp_path, MINIMAL + line + "\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert expected in str(e.value)
    assert len(e.value.problems) == 1


def test_all_problems_are_reported_together(tmp_path):
    p = _write(tmp_path, MINIMAL + "  batch_size: x\n  learnin_rate: 1\ntarget:\n  dtyp: bf16\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    paths = sorted(k for k, _ in e.value.problems)
    assert paths == ["target.dtyp", "training.batch_size", "training.learnin_rate"]
    assert "3 problems" in str(e.value)


def test_section_of_the_wrong_type(tmp_path):
    with pytest.raises(RecipeError, match="training: expected a mapping, got list"):
        load_recipe(_write(tmp_path, "method: eagle3\ntraining: [1, 2]\n"))


def test_option_of_another_method_says_which(tmp_path):
    p = _write(tmp_path, "method: medusa1\ntraining: {max_steps: 5}\nspeculator:\n  lora: {r: 8}\n")
    with pytest.raises(RecipeError, match="unknown key 'lora' in speculator \\(method medusa1\\); it is an option "
                                          "of medusa2 speculators"):
        load_recipe(p)


def test_unknown_method_and_missing_method(tmp_path):
    with pytest.raises(RecipeError, match="'eagle2' is not one of eagle3, eagle, medusa1, medusa2, draft; did you mean"):
        load_recipe(_write(tmp_path, "method: eagle2\ntraining: {max_steps: 5}\n"))
    with pytest.raises(RecipeError, match="required key 'method' is missing"):
        load_recipe(_write(tmp_path, "training: {max_steps: 5}\n"))


def test_duplicate_yaml_key_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="duplicate key 'max_steps'"):
        load_recipe(_write(tmp_path, "method: eagle3\ntraining:\n  max_steps: 5\n  max_steps: 6\n"))


def test_exponent_without_dot_is_a_float_and_dtype_aliases_normalise(tmp_path):
    r = load_recipe(_write(tmp_path, MINIMAL + "  learning_rate: 1e-4\ntarget: {dtype: bfloat16}\n"))
    assert r.training.learning_rate == pytest.approx(1e-4)
    assert r.target.dtype == "bf16"


def test_unknown_recipe_name_suggests():
    with pytest.raises(RecipeError, match="did you mean 'eagle3-smollm2-135m'"):
        load_recipe("eagle3-smollm2-13m")


def test_overrides_patch_before_validation():
    r = load_recipe("eagle3-smollm2-135m", ["training.max_steps=7", "data.prompts.0.count=64"])
    assert r.training.max_steps == 7 and r.data.prompts[0].count == 64
    with pytest.raises(RecipeError, match="unknown key 'max_step' in training; did you mean 'max_steps'"):
        load_recipe("eagle3-smollm2-135m", {"training.max_step": 7})


CROSS = [
    ("method: medusa2\ntraining: {max_steps: 5}\n", "speculator.lora: medusa2 trains the backbone jointly"),
    ("method: eagle3\ntraining: {batch_size: 4}\n", "training: set max_steps or epochs"),
    (MINIMAL + "launcher: {config: single-cpu, deepspeed: zero3}\n", "launcher.deepspeed: a ZeRO config needs a "
                                                                      "DeepSpeed launcher"),
    (MINIMAL + "launcher: {config: zero3}\n", "launcher.deepspeed: accelerate config 'zero3' launches DeepSpeed"),
    ("method: medusa1\ntraining: {max_steps: 5, ttt_steps: 3}\n", "training.ttt_steps: training-time-test "
                                                                  "unrolling is EAGLE-3 only"),
    (MINIMAL + "  precision: fp16\n", "training.precision: fp16 mixed precision needs CUDA"),
    (MINIMAL + "target: {placement: zero3}\n", "target.placement: zero3 placement partitions the target"),
    (MINIMAL + "target: {placement: zero3}\ndata: {hidden_states: offline}\nlauncher: {config: zero-cpu-2proc, "
     "deepspeed: zero3}\n", "target.placement: zero3 placement needs data.hidden_states: online"),
    ("method: draft\ntraining: {max_steps: 5}\nspeculator: {layers: [0, 2]}\ntarget: {placement: zero3}\n"
     "launcher: {config: zero-cpu-2proc, deepspeed: zero3}\n", "a draft built from target layers"),
    ("method: draft\ntraining: {max_steps: 5}\nspeculator: {layers: [0, 2], init_from: llama-3.2-1b}\n",
     "a draft needs exactly one of layers"),
    ("method: draft\ntraining: {max_steps: 5}\n", "got none"),
    (MINIMAL + "data: {prompts: [{source: magpie, count: 8}], eval_prompts: 8}\n",
     "data.eval_prompts: holds out 8 of only 8 prompts"),
    ("method: medusa1\ntraining: {max_steps: 5}\nspeculator: {choices: [[0], [1, 0]]}\n",
     "the prefix [1] of a path is missing"),
    ("method: medusa1\ntraining: {max_steps: 5}\nspeculator: {choices: fit}\n",
     "speculator.choices: 'fit' needs held-out sequences: set training.eval_every > 0"),
    ("method: medusa2\ntraining: {max_steps: 5, eval_every: 2}\nspeculator: {lora: {r: 4}, choices: fit}\n"
     "data: {hidden_states: online}\n", "speculator.choices: 'fit' measures the heads on the frozen target"),
    ("method: medusa1\ntraining: {max_steps: 5}\nspeculator: {choices: grow}\n", "choices"),
    ("method: medusa2\ntraining: {max_steps: 5}\nspeculator: {lora: {r: 4}}\ndata: {hidden_states: offline}\n",
     "data.hidden_states: medusa2 trains the backbone"),
    ("method: eagle\ntraining: {max_steps: 5}\ntarget: {feature_layers: [3, 4]}\n",
     "target.feature_layers: eagle reads exactly one feature"),
    (MINIMAL + "evaluation: {prompt_sets: [builtin-heldot]}\n", "did you mean 'builtin-heldout'"),
    (MINIMAL + "launcher: {config: ddp-2proc, num_processes: 3, num_machines: 2}\n",
     "3 processes do not split evenly over 2 machines"),
    (MINIMAL + "data: {responses: {temperature: 0.7, sampled_fraction: 0.5}}\n",
     "data.responses.sampled_fraction: temperature 0.7 already samples every answer"),
]


@pytest.mark.parametrize("text, expected", CROSS)
def test_cross_field_errors(tmp_path, text, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe(_write(tmp_path, text))
    assert expected in str(e.value)


def test_minimal_recipe_gets_sensible_defaults(tmp_path):
    r = load_recipe(_write(tmp_path, MINIMAL, name="tiny.yaml"))
    assert r.name == "tiny" and r.target.name == "smollm2-135m"
    assert r.training.position_weight_decay == 0.8 and r.launcher.config == "single-cpu"
    assert r.tracking.log_model is False and r.evaluation.temperatures == [0.0, 1.0]
    # defaults are per instance, never shared
    r2 = load_recipe(_write(tmp_path, MINIMAL, name="tiny2.yaml"))
    r.data.prompts.append(r.data.prompts[0])
    assert len(r2.data.prompts) == 1


# ---------------------------------------------------------------------------- resolve / dump

@pytest.mark.parametrize("name", ["eagle3-smollm2-135m", "eagle-llama3-70b", "medusa2-llama3-8b"])
def test_dump_resolved_round_trips(tmp_path, monkeypatch, name):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    r = load_recipe(name)
    out = dump_resolved(r, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt" / RESOLVED_FILENAME
    back = load_recipe(out)
    want = resolve(r)
    assert back == want and resolve(want) == want  # resolving is idempotent
    d = back.to_dict()
    assert d["output_dir"] == f"runs/{name}" and d["data"]["cache_dir"]
    assert d["data"]["responses"]["dtype"] == want.target.dtype != "auto"
    assert d["training"]["precision"] in ("fp32", "bf16", "fp16")
    assert d["tracking"]["wandb_mode"] == "offline" and d["tracking"]["run_name"] == name
    assert d["launcher"]["num_processes"] >= 1 and d["target"]["placement"] != "auto"
    assert d["target"]["feature_layers"]  # filled from the preset, no download


def test_resolved_defaults_depend_on_method_and_environment(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x")
    r = resolve(load_recipe("eagle-llama3-70b"))
    assert r.tracking.wandb_mode == "online"
    assert r.target.feature_layers == [2, 40, 77] and r.training.ttt_steps == 7
    assert r.target.placement == "zero3" and r.target.device == "cuda"
    m = resolve(load_recipe("medusa1-smollm2-135m"))
    assert m.target.feature_layers == [30] and m.training.ttt_steps is None


def test_prompt_source_dicts_fit_the_prompt_loader():
    r = load_recipe("eagle-llama3-70b")
    hub, magpie = prompt_source_dicts(r)
    assert hub == {"source": "hub", "name": "HuggingFaceH4/ultrachat_200k", "subset": None, "split": "train_sft",
                   "limit": 120000, "shuffle": False}
    assert magpie["topics"] is None and magpie["count"] == 20000 and magpie["dtype"] == "bf16"


def test_a_file_source_can_sample_its_limit_at_random(tmp_path):
    from specfoundry.train.prompts import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    first, sampled = (recipe_from_dict({"method": "eagle3", "training": {"max_steps": 1}, "data": {
        "eval_prompts": 1, "prompts": [{"source": "file", "path": str(f), "limit": 5, **extra}]}})
        for extra in ({}, {"shuffle": True}))
    assert load_prompts(prompt_source_dicts(first)) == [f"question {i}" for i in range(5)]
    got = load_prompts(prompt_source_dicts(sampled), seed=3)
    assert len(set(got)) == 5 and got != [f"question {i}" for i in range(5)]
    assert got == load_prompts(prompt_source_dicts(sampled), seed=3)  # seeded: the same sample every run
    with pytest.raises(RecipeError, match="shuffle"):
        recipe_from_dict({"method": "eagle3", "data": {"prompts": [{"source": "file", "path": "x", "shuffle": "no"}]}})


def test_launch_args():
    args = launch_args(load_recipe("eagle-llama3-70b"))
    ds = Path(args[args.index("--deepspeed_config_file") + 1])
    assert ds.is_absolute() and ds == deepspeed_config_path("zero3").resolve() and ds.is_file()
    assert args[args.index("--num_processes") + 1] == "8" and args[args.index("--mixed_precision") + 1] == "bf16"
    cpu = launch_args(load_recipe("eagle3-smollm2-135m"))
    assert "--deepspeed_config_file" not in cpu and cpu[cpu.index("--num_processes") + 1] == "1"


# ---------------------------------------------------------------------------- presets / plan

@pytest.mark.parametrize("name, params", [
    ("smollm2-135m", 134.5e6), ("meta-llama/Llama-3.1-8B-Instruct", 8.03e9),
    ("meta-llama/Llama-3.3-70B-Instruct", 70.55e9), ("meta-llama/Llama-3.2-1B", 1.236e9),
])
def test_preset_parameter_counts_match_the_published_sizes(name, params):
    assert presets.resolve_architecture(name).param_count() == pytest.approx(params, rel=0.005)


def test_local_directory_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True}))
    a = presets.resolve_architecture(str(tmp_path))
    assert (a.hidden_size, a.num_layers, a.num_key_value_heads, a.vocab_size) == (64, 2, 4, 100)
    assert a.param_count() == 100 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    with pytest.raises(presets.PresetError, match="never downloads"):
        presets.resolve_architecture("someone/unknown-model")


@pytest.mark.parametrize("name", list_recipes())
def test_plan_computes_for_every_recipe(name):
    plan = make_plan(load_recipe(name))
    text = format_plan(plan)
    assert name in text and ("memory per device" in text or "host RAM per process" in text)
    assert plan.steps and plan.steps > 0 and plan.global_batch >= 1
    assert 0 < plan.speculator.trainable <= plan.speculator.total
    assert plan.memory.total > plan.memory.activations > 0
    assert plan.total_tokens and plan.total_tokens > 0
    if plan.device_memory:
        assert plan.fits, text  # the GPU recipes are sized to fit their stated device


def test_auto_placement_partitions_the_target_only_where_the_run_can():
    """placement auto -> zero3 under ZeRO-3 with several processes, except where the main process
    alone needs the whole target during training (offline capture) or the target trains (Medusa-2)."""
    z3 = {"launcher.config": "zero-cpu-2proc", "launcher.deepspeed": "zero3", "target.placement": "auto"}
    assert resolve(load_recipe("eagle3-smollm2-135m", {**z3, "data.hidden_states": "online"})).target.placement == "zero3"
    assert resolve(load_recipe("eagle3-smollm2-135m", {**z3, "data.hidden_states": "offline"})).target.placement \
        == "replicate"
    assert resolve(load_recipe("eagle3-smollm2-135m", {**z3, "launcher.deepspeed": "zero2"})).target.placement \
        == "replicate"
    online = make_plan(load_recipe("eagle3-smollm2-135m", {**z3, "data.hidden_states": "online"}))
    assert online.placement == "zero3" and online.memory.target_weights < online.target_weight_bytes


def test_70b_plan_numbers_are_sane():
    r = load_recipe("eagle-llama3-70b")
    plan = make_plan(r)
    assert plan.target_weight_bytes / GB == pytest.approx(141.1, abs=0.5)  # 70.55B x 2 bytes
    assert 1.2e9 < plan.speculator.trainable < 1.6e9  # fc 3H^2 + a 2H-input layer + 32k LM head
    z3, z2, z0 = (make_plan(r, zero_stage=s).memory.total for s in (3, 2, 0))
    assert z3 < z2 < z0
    assert plan.memory.total == pytest.approx(z3)
    m = plan.memory
    # placement zero3 (train/zero3_target.py): 1/8 of every parameter but the LM head, plus whole
    # copies of the LM head and the embedding (the head reads both every step); gathering two
    # layers or the (larger) embedding at a time
    A = plan.target
    whole = (A.embedding_params() + A.lm_head_params()) * 2
    assert m.target_weights == pytest.approx((plan.target_weight_bytes - A.lm_head_params() * 2) / 8 + whole)
    assert 20 * GB < m.target_weights < 23 * GB
    assert m.gather_buffers == pytest.approx(2 * max(A.layer_params(), A.embedding_params()) * 2)
    assert not any("whole frozen target" in w for w in plan.warnings), plan.warnings
    assert make_plan(r, zero_stage=2).memory.target_weights == pytest.approx(plan.target_weight_bytes)
    # no ZeRO: 16 bytes of weights/grads/Adam per trainable parameter; ZeRO-3 divides them by 8
    z0m = make_plan(r, zero_stage=0).memory
    assert z0m.trainable_weights + z0m.gradients + z0m.optimizer_states == pytest.approx(16 * plan.speculator.trainable)
    assert m.trainable_weights + m.gradients + m.optimizer_states == pytest.approx(16 * plan.speculator.trainable / 8)
    assert plan.fits and m.total < 80 * GB


def _native_bf16(monkeypatch, native: bool, pays: bool | None = None):
    import specfoundry.train.hardware as hw

    monkeypatch.setattr(hw, "cpu_has_native_bf16", lambda *a: native)
    monkeypatch.setattr(hw, "cpu_bf16_products_pay", lambda *a: native if pays is None else pays)


@pytest.mark.parametrize("native,pays", [(True, True), (True, False), (False, False)])
def test_precision_auto_follows_the_cpu(monkeypatch, native, pays):
    _native_bf16(monkeypatch, native, pays)
    want = "bf16" if native else "fp32"
    step = "bf16" if pays else "fp32"  # an Intel CPU without AMX: bf16 weights, an fp32 training step
    r = resolve(load_recipe("eagle3-smollm2-135m"))
    assert (r.target.dtype, r.data.responses.dtype, r.training.precision) == (want, want, step)
    args = launch_args(load_recipe("eagle3-smollm2-135m"))  # unresolved: the same answer
    assert args[args.index("--mixed_precision") + 1] == ("bf16" if pays else "no")
    # named values are kept, and GPU recipes resolve auto to bf16 whatever the host CPU has
    assert resolve(load_recipe("eagle3-smollm2-135m", {"training.precision": "fp32"})).training.precision == "fp32"
    gpu = resolve(load_recipe("eagle-llama3-70b", {"target.dtype": "auto", "training.precision": "auto"}))
    assert (gpu.target.dtype, gpu.training.precision) == ("bf16", "bf16")


def test_cpu_bf16_flags(tmp_path):
    from specfoundry.train.hardware import cpu_has_native_bf16

    for flags, native in (("fpu sse2 avx2 fma", False), ("avx512f avx512bw avx512_bf16", True),
                          ("avx512f amx_tile amx_bf16", True), ("avx512f avx512bw avx512_vnni", False)):
        f = tmp_path / f"cpuinfo-{native}-{len(flags)}"
        f.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
        assert cpu_has_native_bf16(str(f)) is native, flags
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert cpu_has_native_bf16(str(arm)) is True
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False


def test_bf16_training_pays_on_amx_or_amd_avx512_bf16_not_on_intel_without_amx(tmp_path):
    from specfoundry.train.hardware import cpu_bf16_products_pay

    for vendor, flags, pays in (("GenuineIntel", "avx512f avx512_bf16", False),  # Sapphire/Emerald Rapids, no AMX
                                ("GenuineIntel", "avx512f avx512_bf16 amx_tile amx_bf16", True),
                                ("AuthenticAMD", "avx512f avx512_bf16", True),  # Zen 4+
                                ("AuthenticAMD", "avx2 fma", False), ("GenuineIntel", "avx2 fma", False)):
        f = tmp_path / f"cpuinfo-{vendor}-{len(flags)}"
        f.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\n"
                     f"processor\t: 1\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n")
        assert cpu_bf16_products_pay(str(f)) is pays, (vendor, flags)
    arm = tmp_path / "arm"  # no vendor_id line: Arm's bf16 counts as paying, as before
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert cpu_bf16_products_pay(str(arm)) is True


def test_default_recipe_fits_the_20_minute_budget(monkeypatch):
    # the stage estimates are rates measured on a CPU with avx512_bf16 (the recipe's bf16 plan)
    _native_bf16(monkeypatch, True)
    plan = make_plan(load_recipe("eagle3-smollm2-135m"))
    caps = plan.budget_s
    assert all(v is not None for v in caps.values()) and sum(caps.values()) <= 20 * 60
    estimate = sum(min(e, caps[k]) for k, e in (("data", plan.data_s), ("training", plan.train_s),
                                                ("evaluation", plan.eval_s), ("runtime shape", plan.shape_s)))
    # the offline capture runs after the data budget: the budgets plus it must still fit
    assert plan.capture_s is not None and estimate + plan.capture_s <= 20 * 60
    assert sum(caps.values()) + plan.capture_s <= 20 * 60
    assert plan.data_s <= caps["data"], "the data budget would cut the default recipe's prompts"
    assert plan.train_s <= caps["training"], "the training guard would stop the default recipe's planned steps"
    assert plan.eval_s <= caps["evaluation"], "the evaluation guard would cut the default recipe's cells"
    assert plan.shape_s <= caps["runtime shape"], "the runtime-shape guard would cut its prompts"
    assert plan.device == "cpu" and plan.world_size == 1
    long = make_plan(load_recipe("eagle3-smollm2-135m-long"))
    assert sum(long.budget_s.values()) <= 120 * 60
    # without native bf16 (fp32 batched work) the earlier 784-prompt size no longer fits: its guard
    # cuts the data, the plan says so, and the stage budgets still hold the run to 20 minutes
    _native_bf16(monkeypatch, False)
    slow = make_plan(load_recipe("eagle3-smollm2-135m", overrides=["data.prompts.0.count=784"]))
    assert slow.recipe.target.dtype == "fp32" and slow.data_s > slow.budget_s["data"]
    assert any("data estimated" in w and "cut at its 8.5 min budget" in w for w in slow.warnings)
    assert sum(slow.budget_s.values()) + slow.capture_s <= 20 * 60


def test_plan_rejects_recipes_that_do_not_fit_the_target_shape():
    with pytest.raises(RecipeError, match=r"speculator.layers: \[30\] are not layers of a 30-layer target"):
        make_plan(load_recipe("draft-smollm2-135m", {"speculator.layers": [0, 30]}))
    with pytest.raises(RecipeError, match="exceeds the target vocabulary 49152"):
        make_plan(load_recipe("eagle3-smollm2-135m", {"speculator.draft_vocab_size": 50000}))
    with pytest.raises(RecipeError, match="target.name: no architecture preset"):
        make_plan(load_recipe("eagle3-smollm2-135m", {"target.name": "someone/unknown-model"}))


def test_dry_run_plan_needs_no_network_or_model(tmp_path):
    # a fresh interpreter with sockets disabled and empty caches: GPU-recipe targets are not local,
    # so the plan must come from presets alone, without transformers or the hub
    for name in GPU_RECIPES:
        target = load_recipe(name).target.name
        assert not Path(target).exists() and presets.find_architecture(target) is not None
    code = textwrap.dedent(f"""
        import socket, sys
        def no_net(*a, **k):
            raise RuntimeError("network access during a dry run")
        socket.socket.connect = no_net
        socket.create_connection = no_net
        from specfoundry.train.recipe import load_recipe
        from specfoundry.train.plan import make_plan, format_plan
        for name in {GPU_RECIPES!r}:
            format_plan(make_plan(load_recipe(name)))
        bad = [m for m in ("transformers", "huggingface_hub", "datasets", "deepspeed") if m in sys.modules]
        assert not bad, bad
        print("ok")
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "SPECFOUNDRY_CACHE": str(tmp_path / "cache"),
           "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
    assert not (tmp_path / "hf").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", ["eagle3-smollm2-135m-real", "eagle3-smollm2-135m-mix"])
def test_real_prompt_recipes_train_on_nothing_the_evaluation_sets_hold(name):
    """The recipes that train on ../shared/data/train prompts are evaluated on MT-bench and
    Spec-Bench: no training prompt may be one of those (compared by normalised text)."""
    from specfoundry.train.prompts import normalize_for_dedup, read_prompt_file

    r = load_recipe(name)
    files = [s.path for s in r.data.prompts if s.source == "file"]
    evals = [ROOT / p for p in ("../shared/data/eval/mt_bench/question.jsonl", "../shared/data/eval/spec_bench/question.jsonl")]
    if not files or not all((ROOT / f).exists() for f in files) or not all(e.exists() for e in evals):
        pytest.skip("../shared/data (public prompt files) is not present on this machine")
    held = {normalize_for_dedup(p) for e in evals for p in read_prompt_file(e)}
    assert len(held) > 400  # both sets were read
    train = {normalize_for_dedup(p) for f in files for p in read_prompt_file(ROOT / f)}
    assert train and not train & held, sorted(train & held)[:3]
