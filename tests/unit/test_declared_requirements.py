"""Every package the code imports when a module loads is one setup.py requires, with a floor the
floor environment installs and tests (tests/floor/requirements.py): not one that arrives only as
a dependency of DeepSpeed or transformers, untested at any version."""

from __future__ import annotations

import ast
import sys

from packaging.requirements import Requirement

from tests.conftest import REPO
from tests.floor.requirements import install_requires

IMPORT_NAMES = {"yaml": "pyyaml"}
"""Import name -> distribution name, where they differ."""


def module_level_imports() -> dict[str, list[str]]:
    """Third-party top-level names imported at module level in megatron_lite -> the files."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "megatron_lite").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("megatron_lite", "__future__"):
                    found.setdefault(top, []).append(str(path.relative_to(REPO)))
    return found


def test_every_package_imported_at_module_level_is_required_with_a_floor():
    required = {Requirement(r).name.lower() for r in install_requires()}
    imports = module_level_imports()
    assert {"torch", "numpy", "omegaconf"} <= set(imports)  # the scan sees imports at all
    missing = {name: files for name, files in imports.items()
               if IMPORT_NAMES.get(name, name).lower() not in required}
    assert not missing, f"imported but not in setup.py's install_requires: {missing}"


def test_the_preprocessing_progress_bar_is_required_too():
    # Imported where the bar is drawn (inside a function), so the scan above does not see it.
    text = (REPO / "megatron_lite/data/preprocess/driver.py").read_text()
    assert "from tqdm import tqdm" in text
    assert "tqdm" in {Requirement(r).name for r in install_requires()}



def test_deepspeed_has_a_ceiling_and_the_installed_release_is_inside_the_range():
    """DeepSpeed is admitted up to the releases the suite was run on (engine/internals.py relies
    on names a new release may rename): an upper bound, and the tested release inside it."""
    from importlib.metadata import version

    (deepspeed,) = [Requirement(r) for r in install_requires() if Requirement(r).name == "deepspeed"]
    assert any(s.operator == "<" for s in deepspeed.specifier), deepspeed
    assert deepspeed.specifier.contains(version("deepspeed").split("+")[0]), (deepspeed, version("deepspeed"))
