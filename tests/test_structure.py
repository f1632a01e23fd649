"""The codebase's shape, as the design asks for it: no import cycle in maxlm/ (lazy imports
included), modules of at most 450 lines, functions of at most 100, no private name used across
modules, and no config default restated outside config.py."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "maxlm"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 100


def modules() -> dict[str, ast.Module]:
    """{dotted name: parsed source} of every module in maxlm/."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def imported_modules(name: str, tree: ast.Module, known: set[str]) -> dict[str, str]:
    """{local alias: maxlm module} for every import of a maxlm module anywhere in `tree`
    (function bodies included)."""
    aliases = {}
    package = name if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists() else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in known:
                    aliases[a.asname or a.name] = full
                elif base in known:
                    aliases[f"{base}:{a.name}"] = base  # a name from the module: a dependency
    return aliases


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    graph = {}
    for name, tree in trees.items():
        deps = set(imported_modules(name, tree, known).values())
        # importing maxlm.a.b from outside maxlm.a runs maxlm/a/__init__ first
        deps |= {parent for d in deps if d.count(".") > 1
                 for parent in [d.rpartition(".")[0]] if not (name + ".").startswith(parent + ".")}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_lazy_imports_included():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_nothing_below_the_loop_imports_it():
    importers = sorted(name for name, deps in import_graph().items() if "maxlm.train" in deps)
    assert importers == []


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_and_function_sizes(name):
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name} has {lines} lines: split it by responsibility"
    for node in ast.walk(modules()[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{name}.{node.name} has {length} lines"


def test_no_private_name_used_across_modules():
    trees = modules()
    known = set(trees)
    found = []
    for name, tree in trees.items():
        aliases = imported_modules(name, tree, known)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                found += [f"{name}: from {node.module} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert found == []


def test_config_defaults_are_not_restated():
    """A config read goes through config.from_recorded, so code never needs `cfg.get(key, default)`."""
    found = []
    for name, tree in modules().items():
        if name == "maxlm.config":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and len(node.args) == 2):
                target = ast.unparse(node.func.value)
                if "cfg" in target or "config" in target.lower() or target.startswith("c."):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
