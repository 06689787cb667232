"""Every private DeepSpeed/torch name the project relies on (listed once, in
distributed/deepspeed_internals.py) still exists in the installed releases: an upgrade that
renames one fails here, by name, not as a silently wrong gradient norm or update gate."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from pathlib import Path

import pytest

from megatron_lite.distributed.deepspeed_internals import RELIED_ON

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PACKAGE = Path(__file__).resolve().parents[2] / "megatron_lite"


@pytest.mark.parametrize("module, obj, name", RELIED_ON, ids=[f"{m}:{o}:{n}" for m, o, n in RELIED_ON])
def test_relied_on_name_exists(module, obj, name):
    mod = importlib.import_module(module)
    target = mod if obj is None else getattr(mod, obj)
    if name.startswith("="):
        assert target == name[1:]
    else:
        assert hasattr(target, name) or name in inspect.getsource(target), \
            f"{module}.{obj or ''} no longer has '{name}': update distributed/deepspeed_internals.py"


def test_private_names_are_used_only_in_the_adapter():
    """Outside the adapter, no module reads or sets a private DeepSpeed attribute."""
    private = {n for _, _, n in RELIED_ON if not n.startswith("=")} | {"ds_pipe_replicated"}
    private -= {"model_parallel"}  # also a word of our own prose
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "deepspeed_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in private:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} '{node.value}'")
    assert not found, "\n".join(found)
