"""Project structure: every subpackage folder is packaged, and the layering rules hold."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"runtime": "specfoundry.runtime", "train": "specfoundry.train", "export": "specfoundry.export",
          "recipes": "specfoundry.recipes", "bench": "specfoundry.bench"}
# who may not import whom (train and export depend on runtime only; runtime on none of them;
# bench measures the runtime and exported peers, never training code)
FORBIDDEN = {"runtime": {"train", "export", "bench"}, "train": {"export", "bench"}, "export": {"train", "bench"},
             "bench": {"train"}}
# import cycles tolerated for now, each as sorted module names (to be removed, never added to);
# none today
KNOWN_CYCLES: list[list[str]] = []


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


def _module_files(root: Path) -> dict[str, Path]:
    out = {}
    for folder, pkg in MAPPED.items():
        for py in (root / folder).rglob("*.py"):
            rel = py.relative_to(root / folder).with_suffix("").parts
            out[".".join([pkg, *(rel[:-1] if rel[-1] == "__init__" else rel)])] = py
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in the file (an import inside a function
    to dodge a cycle is still a cycle)."""
    mods = _module_files(root)
    graph = {m: set() for m in mods}
    for m, py in mods.items():
        for node in ast.walk(ast.parse(py.read_text(), filename=str(py))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = m.split(".") if py.name == "__init__.py" else m.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                names = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            else:
                continue
            graph[m].update(n for n in names if n in mods and n != m)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    cycles = [c for c in find_cycles(import_graph(ROOT)) if c not in KNOWN_CYCLES]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_check_catches_cycles(tmp_path):
    for folder in MAPPED:
        (tmp_path / folder).mkdir()
    (tmp_path / "train" / "a.py").write_text("def f():\n    from .b import x\n")
    (tmp_path / "train" / "b.py").write_text("from . import a\n")
    (tmp_path / "train" / "c.py").write_text("from .a import f\n")
    assert find_cycles(import_graph(tmp_path)) == [["specfoundry.train.a", "specfoundry.train.b"]]
