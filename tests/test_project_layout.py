"""Project structure: every subpackage folder is packaged, and the layering rules hold."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"runtime": "specfoundry.runtime", "train": "specfoundry.train", "export": "specfoundry.export",
          "recipes": "specfoundry.recipes"}
# who may not import whom (train and export depend on runtime only; runtime on neither)
FORBIDDEN = {"runtime": {"train", "export"}, "train": {"export"}, "export": {"train"}}


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders():
    for folder in MAPPED:
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            yield folder, ".".join([MAPPED[folder], *rel.parts])


def test_every_subpackage_is_listed_in_packages():
    cfg = _pyproject()["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {name for _, name in _package_folders()}
    assert found, "no packages found"
    missing = sorted(found - listed)
    assert not missing, f"subpackage folders missing from [tool.setuptools] packages: {missing}"
    for folder, name in MAPPED.items():
        assert cfg["package-dir"][name] == folder


def test_folders_without_init_are_not_code():
    # a folder with .py files but no __init__.py would silently not be packaged
    for folder in MAPPED:
        for py in (ROOT / folder).rglob("*.py"):
            assert (py.parent / "__init__.py").exists(), f"{py} is in a folder without __init__.py"


def _imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield (node.module or ""), node.level


def find_violations(root: Path) -> list[str]:
    bad = []
    for folder in MAPPED:
        for py in (root / folder).rglob("*.py"):
            rel = py.parent.relative_to(root / folder).parts
            for module, level in _imports(py):
                if level:
                    base = [*MAPPED[folder].split("."), *rel]
                    base = base[: len(base) - (level - 1)]
                    target = ".".join([*base, module] if module else base)
                else:
                    target = module
                parts = target.split(".")
                if level == 0 and parts[0] in MAPPED:
                    bad.append(f"{py.relative_to(root)}: bare `import {target}` (use specfoundry.{target})")
                if len(parts) >= 2 and parts[0] == "specfoundry" and parts[1] in FORBIDDEN.get(folder, set()):
                    bad.append(f"{py.relative_to(root)}: {folder} must not import {target}")
    return bad


def test_layering_rules():
    bad = find_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_layering_check_catches_violations(tmp_path):
    # the checker itself must be able to fail
    for folder in MAPPED:
        (tmp_path / folder / "sub").mkdir(parents=True)
    (tmp_path / "runtime" / "a.py").write_text("from specfoundry.train import something\nimport runtime.tree\n")
    (tmp_path / "train" / "sub" / "b.py").write_text("from ...export import x\nfrom ...runtime import ok\n")
    bad = "\n".join(find_violations(tmp_path))
    assert "runtime must not import specfoundry.train" in bad
    assert "bare `import runtime.tree`" in bad
    assert "train must not import specfoundry.export" in bad
    assert "import specfoundry.runtime" not in bad  # train -> runtime is allowed
