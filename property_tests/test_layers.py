"""The layers only point down: ``reference`` <- ``cb_impl`` <- ``cbverify`` <- ``golden``, ``bench``, tests.

Read from every Python file's AST: ``import`` and ``from ... import`` statements anywhere (inside functions too), and
every string constant that is exactly a dotted path into one of our packages (``importlib.import_module("...")``,
``find_spec``, ``python -m ...`` argument lists, registries of module names): a hidden import is still an import.
Test files (``test_*.py``, ``conftest.py``, everything under ``property_tests/``) may import anything.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
OURS = ("reference", "cb_impl", "cbverify", "golden", "bench", "property_tests")
ALLOWED = {
    "reference": {"reference"},
    "cb_impl": {"cb_impl", "reference.spec"},
    "cbverify": {"cbverify", "cb_impl", "reference"},
    "golden": {"golden", "cbverify", "cb_impl", "reference"},
    "bench": {"bench", "cbverify", "cb_impl", "reference"},
}
# a string counts when it is a dotted path (a bare "golden" is as likely a folder or subcommand name as a module)
MODULE_PATH = re.compile(rf"^(?:{'|'.join(OURS)})(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")


def imported_names(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names imported from it)`` for every import in ``path``, static or spelled as a string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this file's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_PATH.match(node.value):
            found.append((node.lineno, node.value, ()))
    return sorted(found)


def violations(path: Path) -> list[str]:
    """Every import in ``path`` (a non-test file of layer ``path.parts[0]``) against the direction of the layers."""
    layer = path.relative_to(REPO).parts[0]
    allowed = ALLOWED[layer]
    bad = []
    for line, module, names in imported_names(path):
        if module.split(".")[0] not in OURS:
            continue  # the standard library and third-party packages
        if not any(module == a or module.startswith(a + ".") for a in allowed):
            bad.append(f"{path.relative_to(REPO)}:{line}: imports {module} ({layer} may import {sorted(allowed)})")
        elif layer == "cb_impl" and module == "reference.spec" and any(n.startswith("_") for n in names):
            bad.append(f"{path.relative_to(REPO)}:{line}: imports private names {names} of reference.spec")
    return bad


def layered_files() -> list[Path]:
    files = []
    for layer in ALLOWED:
        for path in sorted((REPO / layer).rglob("*.py")):
            if not path.name.startswith("test_") and path.name != "conftest.py":
                files.append(path)
    return files


def test_every_layer_has_files_so_the_check_cannot_pass_vacuously():
    layers = {p.relative_to(REPO).parts[0] for p in layered_files()}
    assert layers == set(ALLOWED)
    assert len(layered_files()) > 50


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_only_point_down_the_layers(layer):
    bad = [v for path in layered_files() if path.relative_to(REPO).parts[0] == layer for v in violations(path)]
    assert not bad, "imports against the direction of the layers:\n" + "\n".join(bad)


def test_the_checker_sees_static_nested_relative_and_string_imports(tmp_path, monkeypatch):
    """The checker itself: each way of spelling an upward import in ``reference/`` is reported."""
    fake = tmp_path / "reference"
    fake.mkdir()
    (fake / "upward.py").write_text(
        "import cbverify\n"
        "def f():\n    from cb_impl.engine import LLMEngine\n"
        "import importlib\nimportlib.import_module('golden.build_models')\n"
        "from ..cbverify import compare\n"
        "from reference import spec\n"  # allowed
    )
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    found = violations(fake / "upward.py")
    assert [v.split(": imports ")[1].split(" ")[0] for v in found] == ["cbverify", "cb_impl.engine",
                                                                       "golden.build_models", "cbverify"]  # fmt: skip


def test_the_campaign_package_is_imported_only_by_the_cli():
    """``cbverify.campaign`` (local and Ray backends) sits just under the CLI: no other product module imports it."""
    bad = []
    for path in layered_files():
        inside = path.relative_to(REPO).parts[:2]
        if inside in (("cbverify", "cli"), ("cbverify", "campaign")):
            continue
        bad += [f"{path.relative_to(REPO)}:{line}: imports {module}" for line, module, _ in imported_names(path)
                if module == "cbverify.campaign" or module.startswith("cbverify.campaign.")]  # fmt: skip
    assert not bad, "\n".join(bad)
