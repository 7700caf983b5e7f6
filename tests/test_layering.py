"""Package layering (issue 40): config <- models <- sampling <- rl <- train <- cli/bench/preflight,
with envs, data and the small top-level helpers beside models. No module imports a higher layer,
at module level or inside a function, and package modules import each other without cycles.
Static: the sources are parsed, nothing is imported."""

import ast
import functools
import pathlib

import pytest

import marft_jax

PACKAGE_DIR = pathlib.Path(marft_jax.__file__).parent

# The layer of each top-level module or sub-package of marft_jax (a new one must be placed here).
LAYERS = {
    "config": 0,                 # imports nothing of the package
    "models": 1, "envs": 1, "data": 1,
    "hub": 1,                    # Hub downloads: read by models (weights) and data (datasets)
    "native_build": 1,           # compiles the C++ kernels of models/ and rl/
    "distributed": 1,            # processes, devices and the mesh (reads models' config and sharding)
    "profiling": 1,              # jax.profiler windows (imports nothing of the package)
    "sampling": 2,
    "rl": 3,
    "train": 4,
    "cli": 5, "bench": 5, "preflight": 5,
}
NAMES = {0: "config", 1: "models/envs/data", 2: "sampling", 3: "rl", 4: "train", 5: "cli/bench/preflight"}


def module_name(path: pathlib.Path) -> str:
    parts = ("marft_jax", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source`` (any depth: functions too) of a module inside
    ``package`` (dotted); relative imports are resolved, and ``from a import b`` names both ``a``
    and ``a.b``."""
    parts = package.split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def layer(module: str) -> int | None:
    """The layer of a ``marft_jax`` module (the package root: 0), None outside the package."""
    parts = module.split(".")
    if parts[0] != "marft_jax":
        return None
    return 0 if len(parts) == 1 else LAYERS[parts[1]]


SOURCES = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


@functools.cache
def package_imports() -> dict[str, list[tuple[int, str]]]:
    """Per package module, (line, module) of the package modules it imports (existing ones only)."""
    out = {}
    for name, path in SOURCES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out[name] = [(line, m) for line, m in imported_modules(path.read_text(), package)
                     if m in SOURCES and m != name]
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("source, imported", [
    ("from marft_jax.train.state import TrainState", "marft_jax.train.state"),
    ("import marft_jax.train.metrics as m", "marft_jax.train.metrics"),
    ("from marft_jax import train", "marft_jax.train"),
    ("def f():\n    from ..train import state", "marft_jax.train.state"),
    ("from ..models import lora", "marft_jax.models.lora"),
    ("from . import layout", "marft_jax.rl.layout"),
])
def test_the_check_sees_absolute_relative_and_nested_imports(source, imported):
    assert imported in [m for _, m in imported_modules(source, "marft_jax.rl")]


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
])
def test_the_cycle_check_finds_circles(edges, expected):
    assert cycles(edges) == expected


def test_every_part_of_the_package_has_a_layer():
    tops = {p.stem for p in PACKAGE_DIR.glob("*.py") if p.name != "__init__.py"}
    tops |= {p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py")}
    assert tops == set(LAYERS), (f"place these in LAYERS: {sorted(tops - set(LAYERS))}; "
                                 f"gone: {sorted(set(LAYERS) - tops)}")


def test_no_module_imports_a_higher_layer():
    assert "marft_jax.config" in SOURCES and "marft_jax.rl.update" in SOURCES
    bad = []
    for name, imports in package_imports().items():
        for line, target in imports:
            if layer(target) > layer(name):
                bad.append(f"{SOURCES[name].relative_to(PACKAGE_DIR)}:{line}: {target} "
                           f"({NAMES[layer(name)]} layer imports the {NAMES[layer(target)]} layer)")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_config_imports_nothing_of_the_package():
    source = (PACKAGE_DIR / "config.py").read_text()
    assert not [m for _, m in imported_modules(source, "marft_jax") if m.split(".")[0] == "marft_jax"]


def test_package_modules_import_each_other_without_cycles():
    edges = {name: {m for _, m in imports} for name, imports in package_imports().items()}
    assert not cycles(edges), "import cycles (module- or function-level):\n" + "\n".join(
        " <-> ".join(c) for c in cycles(edges))
