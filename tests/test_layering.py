"""Package layering: ``marft_jax/rl`` never imports ``marft_jax/train`` (issue 15's layout)."""

import ast
import pathlib

import pytest

import marft_jax

PACKAGE_DIR = pathlib.Path(marft_jax.__file__).parent


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source`` of a module inside ``package`` (dotted);
    relative imports are resolved, and ``from a import b`` names both ``a`` and ``a.b``."""
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


def is_train(module: str) -> bool:
    return module == "marft_jax.train" or module.startswith("marft_jax.train.")


@pytest.mark.parametrize("source, imports_train", [
    ("from marft_jax.train.state import TrainState", True),
    ("import marft_jax.train.metrics as m", True),
    ("from marft_jax import train", True),
    ("def f():\n    from ..train import state", True),
    ("from ..models import lora", False),
    ("from . import layout", False),
    ("import marft_jax.training_utils", False),
])
def test_the_check_sees_absolute_relative_and_nested_imports(source, imports_train):
    modules = [m for _, m in imported_modules(source, "marft_jax.rl")]
    assert any(is_train(m) for m in modules) == imports_train


def test_rl_never_imports_train():
    rl = PACKAGE_DIR / "rl"
    files = sorted(rl.rglob("*.py"))
    assert rl / "update.py" in files and rl / "state.py" in files
    bad = []
    for path in files:
        package = ".".join(("marft_jax", *path.parent.relative_to(PACKAGE_DIR).parts))
        bad += [f"{path.relative_to(PACKAGE_DIR)}:{line}: {module}"
                for line, module in imported_modules(path.read_text(), package) if is_train(module)]
    assert not bad, "marft_jax/rl imports marft_jax/train:\n" + "\n".join(bad)
