"""Recipes after the tidy-up: the schema is pydantic, overrides go through it, run directories
stay where they were put, the feature-layer rule matches the runtime heads', and the recipe
modules stay small and say what they hold."""

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from specfoundry.train import recipe_schema
from specfoundry.train.recipe import RecipeError, default_feature_layers, load_recipe
from specfoundry.train.recipe_checks import output_dir_problems

ROOT = Path(__file__).resolve().parents[1]
# the modules the tidy-up split (recipes, plan, training data) and the runtime's chat encoder
SPLIT_MODULES = ["train/recipe.py", "train/recipe_schema.py", "train/recipe_checks.py", "train/recipe_errors.py",
                 "train/launcher.py", "train/plan.py", "train/plan_memory.py", "train/data.py", "train/prompts.py",
                 "train/generation.py", "train/datacache.py", "runtime/logs.py", "runtime/chat.py"]


def test_every_section_is_a_strict_pydantic_model():
    for name in recipe_schema.__all__:
        obj = getattr(recipe_schema, name)
        if isinstance(obj, type) and issubclass(obj, BaseModel):
            assert obj.model_config.get("extra") == "forbid", name
            assert obj.model_config.get("strict") is True, name


@pytest.mark.parametrize("override, expected", [
    ("data.prompts.3.count=5", "index 3 is out of range, data.prompts has 1 item(s)"),
    ("data.prompts.first.count=5", "data.prompts is a list; address its items by index"),
    ("data.prompts.0.cont=5", "unknown key 'cont' in data.prompts[0] (source magpie); did you mean 'count'?"),
    ("training.batch_size=eight", "training.batch_size: expected an integer, got str 'eight'"),
    ("training", "is not KEY=VALUE"),
])
def test_set_overrides_fail_with_one_clear_sentence(override, expected):
    with pytest.raises(RecipeError) as e:
        load_recipe("eagle3-smollm2-135m", [override])
    assert expected in str(e.value)


def test_output_dir_stays_inside_unless_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert output_dir_problems("runs/x") == [] and output_dir_problems(None) == []
    assert "leaves the working directory" in output_dir_problems("../../..")[0][1]
    assert "leaves the working directory" in output_dir_problems("runs/../../elsewhere")[0][1]
    assert "existing file" in output_dir_problems("afile")[0][1]
    assert "existing file" in output_dir_problems(str(tmp_path / "afile"))[0][1]
    assert output_dir_problems(str(tmp_path.parent / "explicit")) == []  # absolute: the user's choice
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "runs").symlink_to(tmp_path / "elsewhere")  # runs/ on another disk
    assert output_dir_problems("runs/x", cwd=tmp_path / "work") == []
    with pytest.raises(RecipeError, match="output_dir: '../../..' leaves the working directory"):
        load_recipe("eagle3-smollm2-135m", ["output_dir=../../.."])
    assert load_recipe("eagle3-smollm2-135m", [f"output_dir={tmp_path.parent / 'explicit'}"]).output_dir


@pytest.mark.parametrize("L", [2, 3, 4, 12, 30, 80])
def test_default_feature_layers_match_the_runtime_heads(L):
    from specfoundry.runtime.speculators import Eagle3Head, EagleHead, MedusaHeads

    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=L, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                         vocab_size=100)
    target = SimpleNamespace(num_layers=L, hidden_size=64, vocab_size=100, config=config)
    assert default_feature_layers("eagle3", L) == Eagle3Head.default_architecture(target)["feature_layers"]
    assert default_feature_layers("eagle", L) == EagleHead.default_architecture(target)["feature_layers"]
    assert default_feature_layers("medusa1", L) == MedusaHeads.default_architecture(target)["feature_layers"]
    assert default_feature_layers("draft", L) is None


@pytest.mark.parametrize("module", SPLIT_MODULES)
def test_split_modules_are_small_and_state_their_scope(module):
    path = ROOT / module
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{module} is over 500 lines"
    doc = ast.get_docstring(ast.parse(text))
    assert doc and "Scope" in doc, f"{module} needs a docstring stating its scope"
