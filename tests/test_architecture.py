"""The package's shape: an import graph without cycles and a core free of Django.

Each module of ``redlock_django`` is read as text (``ast``), not imported, so the
test sees every import that runs, including those made inside functions or through
``importlib`` to dodge a cycle. Imports under ``if TYPE_CHECKING:`` never run and
only name a type for annotations: they are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "redlock_django"
#: The layer that takes nodes and plain numbers (STYLE.md §2): no Django, no settings.
CORE = ("exceptions", "protocol", "scripts", "keys", "sockets", "wire")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules ``name`` imports anywhere in its text, and foreign top levels."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for statement in block.body
        for inner in ast.walk(statement)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join([*base, node.module] if node.module else base)
            elif node.module and node.module.startswith("redlock_django"):
                stem = node.module.removeprefix("redlock_django").lstrip(".")
            else:
                targets.add("!" + (node.module or "").split(".")[0])
                continue
            for alias in node.names:
                full = f"{stem}.{alias.name}" if stem else alias.name
                targets.add(full if full in known else stem)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", ""))
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("redlock_django.")
        ):
            # importlib.import_module("redlock_django.x"): an import all the same.
            targets.add(str(node.args[0].value).removeprefix("redlock_django."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("redlock_django."):
                    targets.add(alias.name.removeprefix("redlock_django."))
                else:
                    targets.add("!" + alias.name.split(".")[0])
    targets.discard(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            if target.startswith("!") or target == "":
                continue
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_package_imports_form_no_cycle():
    """No module of the package imports, even lazily, one that imports it back."""
    graph = _graph()
    graph.pop("", None)  # __init__ re-exports the public names, and nothing imports it
    assert _cycle(graph) is None


def test_a_cycle_is_found_when_two_modules_import_each_other():
    assert _cycle({"a": {"b"}, "b": {"a"}, "c": {"!django"}}) == ["a", "b", "a"]


@pytest.mark.parametrize("name", CORE)
def test_core_module_imports_neither_django_nor_the_django_layer(name):
    """The core runs on nodes and numbers: it can be read and tested without Django."""
    graph = _graph()
    reach, todo = set(), [name]
    while todo:
        for target in graph[todo.pop()]:
            if target not in reach:
                reach.add(target)
                if not target.startswith("!"):
                    todo.append(target)
    assert "!django" not in reach
    assert reach.isdisjoint({"conf", "checks", "decorators", "admin", "lock", "nodes"})


def test_the_library_never_imports_its_test_helpers():
    """``redlock_django.testing`` (pytest, server processes) serves users' tests only.

    pytest is not a dependency of the library: nothing outside ``testing`` may reach
    it, and ``testing`` itself imports pytest only in the plugin module.
    """
    graph = _graph()
    library = {n: t for n, t in graph.items() if not n.startswith("testing")}
    for name, targets in library.items():
        assert not {t for t in targets if t.startswith("testing")}, name
        assert "!pytest" not in targets, name
    helpers = {n for n in graph if n.startswith("testing")}
    assert helpers >= {"testing", "testing.plugin", "testing.servers"}
    assert [n for n in sorted(helpers) if "!pytest" in graph[n]] == ["testing.plugin"]
