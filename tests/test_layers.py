"""The architecture as a rule: tlt_core's subpackages are layers, and a module imports only its
own layer and the layers below it, at module top, with no import cycles. Parsed from the
sources with `ast`, so the rule holds for code no test executes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tlt_core"
# Lowest first. `_C` (the extension), `_version` and `config_flags` (flags from config
# dataclasses, standard library only) sit below everything.
LAYERS = ("_C", "_version", "config_flags", "ops", "persistence", "optim", "model", "drafting",
          "engine", "adaptive", "workers", "warmup", "tasks", "rl", "outputs", "integrations",
          "sim", "embedded", "bench", "cli")
# Only these may import the embedded workload: the toolkit below them works on any model.
EMBEDDED_USERS = ("embedded", "bench", "cli")
# Optional third-party dependencies (or version-dependent standard modules), which may be
# imported where they are used: everything else is imported at module top.
LAZY_IMPORTS = ("cupy", "datasets", "math_verify", "matplotlib", "peft", "pyarrow", "ray", "scipy",
                "tomli", "tomllib", "torch.utils.tensorboard", "transformers", "trl", "verl", "wandb",
                "yaml")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES or name in ("tlt_core._C",)


def _layer(module: str) -> int:
    """The layer of a tlt_core module (the top-level package itself is above all layers)."""
    if module == "tlt_core":
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def _resolve(node: ast.ImportFrom, importer: str) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".")
    if not MODULES[importer].name == "__init__.py":
        package = package[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module top) for every import in `module`; a `from X import
    name` of a submodule counts as an import of the submodule."""
    tree = ast.parse(MODULES[module].read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                found.append((target if _is_module(target) else source, node.lineno,
                              id(node) in top_level))
    return found


def _internal(name: str) -> bool:
    return name == "tlt_core" or name.startswith("tlt_core.")


def test_every_module_is_in_a_layer():
    unknown = sorted(m for m in MODULES if m != "tlt_core" and m.split(".")[1] not in LAYERS)
    assert not unknown, f"modules outside every layer (add the subpackage to LAYERS): {unknown}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module):
    if module == "tlt_core":  # the top: it exports names from the layers
        return
    mine = _layer(module)
    for imported, line, _ in _imports(module):
        if not _internal(imported):
            continue
        assert imported != "tlt_core", (
            f"{module}:{line} imports the top-level package, which imports every layer; import "
            "the module that defines the name")
        theirs = _layer(imported)
        assert theirs <= mine, (f"{module}:{line} imports {imported}, a higher layer "
                                f"({LAYERS[theirs]} above {LAYERS[mine]})")
        if imported.split(".")[1] == "embedded":
            assert module.split(".")[1] in EMBEDDED_USERS, (
                f"{module}:{line} imports the embedded workload; only {EMBEDDED_USERS} may")


def test_the_package_imports_without_its_optional_dependencies():
    """What embeds the kernels or the engine (a GPU box, another RL framework) needs neither
    the answer grader's grammar nor the plotting and logging libraries."""
    blocked = ["math_verify", "matplotlib", "wandb", "transformers", "trl", "datasets"]
    script = ("import sys\n"
              f"for name in {blocked!r}: sys.modules[name] = None\n"
              "import tlt_core, tlt_core.ops, tlt_core.engine, tlt_core.rl, tlt_core.cli.main\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=PACKAGE.parent, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_are_at_module_top(module):
    for imported, line, top in _imports(module):
        if top:
            continue
        assert not _internal(imported), (
            f"{module}:{line} imports {imported} inside a function: tlt_core imports belong at "
            "module top, where they show the layer graph")
        assert imported.startswith(LAZY_IMPORTS), (
            f"{module}:{line} imports {imported} inside a function; only optional dependencies "
            f"({', '.join(LAZY_IMPORTS)}) may be imported where they are used")


def test_no_import_cycles():
    graph = {m: sorted({i for i, _, _ in _imports(m) if i in MODULES and i != m})
             for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in graph[module]:
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items()
                                           if p.name == "__init__.py"))
def test_every_package_states_its_contract(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text()))
    assert doc and len(doc.split()) >= 20, f"{package}: its __init__ needs a docstring saying " \
                                           "what the package is and what it does not do"


def test_a_violation_is_caught(tmp_path, monkeypatch):
    """The rule itself: an engine module that imports the RL driver fails it."""
    bad = tmp_path / "tlt_core" / "engine" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from tlt_core.rl.driver import RLDriver\n\n\ndef f():\n"
                   "    from tlt_core.model import Transformer\n")
    monkeypatch.setitem(MODULES, "tlt_core.engine.bad", bad)
    with pytest.raises(AssertionError, match="higher layer"):
        test_imports_go_down_the_layers("tlt_core.engine.bad")
    with pytest.raises(AssertionError, match="inside a function"):
        test_imports_are_at_module_top("tlt_core.engine.bad")
