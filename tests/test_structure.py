"""The codebase's shape, as the design asks for it: the layers (commands → spine → model/data →
config, tools above everything and imported by nothing of the library), no import cycle in maxlm/
(lazy imports included), no private name used across modules, no config default restated outside
config.py, and importing maxlm changes nothing in the environment. Module and function sizes are
guides for reading (README.md), checked loosely: a concern is not split to fit a number."""

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "maxlm"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100

# The layers, bottom first. A module may import modules of its own group and of lower layers only;
# two groups of one layer (the model and the data, say) do not import each other. One training step
# goes down this list once: train → resilience → observe → sharding → optim → model → config → runtime.
LAYERS = (
    ("runtime",),  # errors, console, paths, processes, jax.distributed: what everything may use
    ("config",),
    ("model", "data"),
    ("optim", "hf"),
    ("sharding",),
    ("observe",),
    ("resilience",),  # reads the metrics back (data_position)
    ("checkpoint",),
    ("generate",),
    ("eval",),
    ("train",),
    ("cli",),
    ("commands", "bench"),  # `python -m maxlm.X`, and the tools that measure everything below
)
RANKS = {name: rank for rank, names in enumerate(LAYERS) for name in names}
COMMANDS = {"maxlm.export", "maxlm.plot"}  # the other commands are packages' __main__ modules
MAX_PACKAGE_MODULES = 15


def group(module: str) -> str:
    """The layer group a maxlm module belongs to: its package under maxlm/ (maxlm itself: runtime)."""
    if module == "maxlm.cli":
        return "cli"
    if module.startswith("maxlm.bench"):
        return "bench"
    if module in COMMANDS or module.endswith(".__main__"):
        return "commands"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANKS else "runtime"


@functools.cache  # parsed once: the size check alone asks for them once per module
def modules() -> dict[str, ast.Module]:
    """{dotted name: parsed source} of every module in maxlm/ (read-only: the result is shared)."""
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


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{name} ({group(name)}) imports {dep} ({group(dep)})"
            for name, deps in sorted(graph.items()) for dep in sorted(deps)
            if group(dep) != group(name) and RANKS[group(dep)] >= RANKS[group(name)]]


def test_each_layer_imports_only_the_layers_below():
    assert layer_violations(import_graph()) == []


def test_the_layer_check_finds_violations():
    assert layer_violations({"maxlm.model.transformer": {"maxlm.sharding.mesh"}}) != []  # model → spine
    assert layer_violations({"maxlm.data.dataset": {"maxlm.model"}}) != []  # data ↔ model
    assert layer_violations({"maxlm.train.loop": {"maxlm.cli"}}) != []  # the core → the commands
    assert layer_violations({"maxlm.train.step": {"maxlm.bench.plan"}}) != []  # the spine → tools
    assert layer_violations({"maxlm.train.__main__": {"maxlm.train.loop", "maxlm.cli"}}) == []


def test_the_data_package_is_entered_from_the_top():
    """maxlm/data/dataset.py (`make_dataset`) calls down through the steps' modules; none of them
    imports it, or the package that re-exports it, back (the command `__main__` may)."""
    graph = import_graph()
    top = {"maxlm.data", "maxlm.data.dataset"}
    importers = {name for name, deps in graph.items() if deps & top and name.startswith("maxlm.data.")}
    assert importers <= {"maxlm.data.__main__"}, importers


def test_only_commands_and_tools_import_the_loop_and_cli():
    graph = import_graph()
    for target in ("maxlm.train.loop", "maxlm.cli"):
        importers = {name for name, deps in graph.items() if target in deps}
        assert {group(name) for name in importers} <= {"commands", "bench"}, (target, importers)


def test_importing_maxlm_changes_no_environment_variable():
    """Only commands set XLA_FLAGS (maxlm/cli.py); the third-party libraries are imported first,
    since some set variables of their own."""
    names = sorted(modules())
    code = ("import os, importlib, jax, flax, optax, orbax.checkpoint, grain, tensorflow_datasets\n"
            "before = dict(os.environ)\n"
            f"for name in {[n for n in names if not n.endswith('__main__')]!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)))\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


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
        if name == "maxlm.config" or name.startswith("maxlm.config."):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and len(node.args) == 2):
                target = ast.unparse(node.func.value)
                if "cfg" in target or "config" in target.lower() or target.startswith("c."):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


@pytest.mark.parametrize("command", ["train", "data", "bench", "checkpoint", "eval", "generate", "export", "plot"])
def test_every_command_users_type_is_runnable(command):
    """`python -m maxlm.COMMAND` (the contract's commands) names a module, or a package's
    `__main__`, that runs something when run as a script."""
    module = PACKAGE / command / "__main__.py"
    if not module.exists():
        module = PACKAGE / f"{command}.py"
    tree = ast.parse(module.read_text())
    guards = [node for node in tree.body if isinstance(node, ast.If)
              and ast.unparse(node.test) == "__name__ == '__main__'"]
    assert guards, f"{module} has no `if __name__ == '__main__':`"


def test_only_commands_exit():
    """The library raises; only the commands (and the tools, which are commands) end the process."""
    found = []
    for name, tree in modules().items():
        if group(name) in ("commands", "cli", "bench"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "os._exit", "exit", "quit"):
                found.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Raise) and node.exc is not None and "SystemExit" in ast.unparse(node.exc):
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_every_module_has_a_layer():
    unknown = {name for name in modules() if name.count(".") >= 1 and name.split(".")[1] not in RANKS
               and group(name) == "runtime" and not name.startswith("maxlm.runtime")}
    assert unknown == set(), f"give these a layer in LAYERS: {sorted(unknown)}"


def test_one_training_step_goes_down_the_tree():
    """`python -m maxlm.train` → loop → step → model and optim: each module on the way imports only
    what lies below it (or beside it in its own package), so the step never climbs back."""
    graph = import_graph()
    path = ["maxlm.train.__main__", "maxlm.train.loop", "maxlm.train.step", "maxlm.model.transformer",
            "maxlm.optim.optimizers"]
    for caller, callee in zip(path, path[1:-1]):
        assert callee in graph[caller] or callee.rpartition(".")[0] in graph[caller], (caller, callee)
    assert "maxlm.optim.optimizers" in graph["maxlm.train.step"] or "maxlm.optim" in graph["maxlm.train.step"]
    for name in path:
        climbs = [dep for dep in graph[name] if group(dep) != group(name) and RANKS[group(dep)] >= RANKS[group(name)]]
        assert climbs == [], (name, climbs)


@pytest.mark.parametrize("package", sorted({p.parent for p in PACKAGE.rglob("__init__.py")}))
def test_no_package_holds_more_than_fifteen_modules(package):
    own = [p for p in package.glob("*.py") if p.name != "__init__.py"]
    assert len(own) <= MAX_PACKAGE_MODULES, f"{package.relative_to(PACKAGE.parent)} holds {len(own)} modules: group them by concern"


def test_no_package_binds_a_submodule_name_to_something_else():
    """`from .grouped_matmul import grouped_matmul` in a package's __init__ would make
    `package.grouped_matmul` the function, not the module, for every later importer."""
    found = []
    for init in PACKAGE.rglob("__init__.py"):
        submodules = ({p.stem for p in init.parent.glob("*.py")} - {"__init__"}
                      | {p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()})
        package = ".".join(init.parent.relative_to(PACKAGE.parent).parts)
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module != package:
                found += [f"{init}: {a.name}" for a in node.names if (a.asname or a.name) in submodules]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in submodules:
                found.append(f"{init}: def {node.name}")
    assert found == []


# ----------------------------------------------------------------------------- the module map

ARCHITECTURE_DOC = PACKAGE.parent / "docs" / "architecture.md"
MAP_START = "<!-- module map: written by `python tests/test_structure.py` from the modules' docstrings -->"
MAP_END = "<!-- end of the module map -->"


def first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.search(r"\.(\s|$)", paragraph)
    return paragraph[: match.start() + 1] if match else paragraph


def module_map() -> str:
    """docs/architecture.md's module map: the layers bottom first, each package's modules with the
    first sentence of their docstring (so the map changes when the code does)."""
    by_group: dict[str, list[str]] = {}
    for name, tree in modules().items():
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
        by_group.setdefault(group(name), []).append(
            f"- `{path.relative_to(PACKAGE.parent)}`: {first_sentence(ast.get_docstring(tree) or '')}")
    lines = [MAP_START, ""]
    for rank, names in enumerate(LAYERS):
        for name in names:
            if name in by_group:
                lines += [f"**{name}** (layer {rank})", "", *sorted(by_group[name]), ""]
    return "\n".join(lines + [MAP_END])


def test_the_module_map_is_current():
    text = ARCHITECTURE_DOC.read_text()
    found = text[text.index(MAP_START): text.index(MAP_END) + len(MAP_END)]
    assert found == module_map(), "docs/architecture.md's module map is stale: run `python tests/test_structure.py`"


def test_every_module_says_what_it_is():
    assert [name for name, tree in modules().items() if not ast.get_docstring(tree)] == []


if __name__ == "__main__":
    text = ARCHITECTURE_DOC.read_text()
    start, end = text.index(MAP_START), text.index(MAP_END) + len(MAP_END)
    ARCHITECTURE_DOC.write_text(text[:start] + module_map() + text[end:])


# What goes stale with every upgrade or machine: dates, library versions and speed figures. They
# belong in docs/ (performance.md, testing.md), measured with a command; a docstring states the contract.
STALE = re.compile(r"20\d\d-\d\d-\d\d|\b(?:jax|jaxlib|orbax|flax|optax|grain|libtpu|tensorflow-datasets|transformers"
                   r"|pytest|xdist)\s+\d+\.\d+|\b\d+(?:\.\d+)?x (?:faster|slower)|~ ?\d+(?:\.\d+)? ?(?:ms|s)\b"
                   r"|\b\d+(?:\.\d+)? ?(?:GFLOP/s|GB/s)")


def stale_docstrings(trees: dict[str, ast.Module]) -> list[str]:
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{name}.{getattr(node, 'name', '')}: {m.group(0)!r}"
                          for m in STALE.finditer(ast.get_docstring(node) or "")]
    return found


def test_docstrings_state_contracts_not_measurements():
    assert stale_docstrings(modules()) == []


def test_the_stale_docstring_check_finds_measurements():
    tree = ast.parse('"""Fast: ~44 ms a batch (measured 2026-11-29 on jax 0.12), 1.4x faster."""')
    assert len(stale_docstrings({"m": tree})) == 4
