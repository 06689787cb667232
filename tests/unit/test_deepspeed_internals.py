"""Every private DeepSpeed/torch name the project relies on (listed once, in
distributed/deepspeed_internals.py) still exists in the installed releases: an upgrade that
renames one fails here, by name, not as a silently wrong gradient norm or update gate."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import textwrap
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


def test_deepspeed_zero_grad_still_only_drops_the_gradients():
    """``drop_gradients_from_a_list`` stands in for ``DeepSpeedEngine.zero_grad`` (ZeRO 0): the
    release's method must still do nothing but set every parameter's ``grad`` to None."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    body = ast.parse(textwrap.dedent(inspect.getsource(DeepSpeedEngine.zero_grad))).body[0].body
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert len(body) == 1 and isinstance(body[0], ast.For), ast.unparse(body[0])
    assert [ast.unparse(s) for s in body[0].body] == [f"{ast.unparse(body[0].target.elts[1])}.grad = None"], \
        "DeepSpeedEngine.zero_grad changed: update deepspeed_internals.drop_gradients_from_a_list"


def test_the_list_zero_grad_drops_every_gradient_tied_ones_too():
    from types import SimpleNamespace

    import torch

    from megatron_lite.distributed.deepspeed_internals import drop_gradients_from_a_list

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    model[1].weight = model[0].weight  # tied, as the output layer and the embedding
    engine = SimpleNamespace(module=model)
    drop_gradients_from_a_list(engine)
    model(torch.tensor([1, 2])).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())
