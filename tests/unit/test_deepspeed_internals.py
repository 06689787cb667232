"""Every name of DeepSpeed or torch the project relies on that is not their documented API is
listed once (``RELIED_ON`` in engine/internals.py), and the installed releases still have it:
here the names a module, class or function holds or uses; tests/distributed/test_relied_on.py
the attributes of real engines, optimizers and parameters. No other module uses a private name
of a library unless it is listed below with its own check."""

from __future__ import annotations

import ast
import atexit
import importlib
import inspect
import os
import textwrap
from pathlib import Path

import pytest

from megatron_lite.engine.internals import RELIED_ON

os.environ.setdefault("DS_ACCELERATOR", "cpu")
PACKAGE = Path(__file__).resolve().parents[2] / "megatron_lite"
STATIC = [(where, name) for where, name in RELIED_ON if not where.startswith("built ")]


def resolve(target: str):
    """``MODULE`` or ``MODULE:QUAL.NAME`` -> the object."""
    module, _, qual = target.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return obj


def names_used(source: str) -> set[str]:
    """Every attribute, name, string constant and imported name in ``source``; an import also as
    its whole statement (``from a.b import c``)."""
    used = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.add(node.value)
        elif isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names}
            used |= {f"from {node.module} import {a.name}" for a in node.names}
    return used


@pytest.mark.parametrize("where, name", STATIC, ids=[f"{w}:{n}" for w, n in STATIC])
def test_relied_on_name_is_still_there(where, name):
    kind, target = where.split(" ", 1)
    obj = resolve(target)
    if kind == "attr":
        assert hasattr(obj, name), f"{target} no longer has '{name}': update engine/internals.py"
    elif kind == "body":
        assert name in names_used(inspect.getsource(obj)), \
            f"{target} no longer uses '{name}': update engine/internals.py"
    else:
        assert kind == "value", where
        assert obj == name, f"{target} is {obj!r}, no longer {name!r}: update engine/internals.py"


def test_a_name_that_is_not_there_fails_each_kind_of_check():
    """The checks above can fail: a name the target lacks is found missing by each kind."""
    for kind, target in (("attr", "torch.distributed.distributed_c10d"),
                         ("body", "torch.distributed.distributed_c10d:_get_default_timeout")):
        with pytest.raises(AssertionError, match="no longer"):
            test_relied_on_name_is_still_there(f"{kind} {target}", "no_such_name_anywhere")
    with pytest.raises(AssertionError, match="no longer"):
        test_relied_on_name_is_still_there("value deepspeed.runtime.constants:PIPE_REPLICATED", "other")


# Private names of other libraries the package uses, each with the check that it still exists.
def _omegaconf_node():
    from omegaconf import OmegaConf

    return OmegaConf.create({"a": 1})


OTHER_PRIVATE = {
    "_get_node": lambda: hasattr(_omegaconf_node(), "_get_node"),  # omegaconf (config/load.py)
    "_value": lambda: hasattr(_omegaconf_node()._get_node("a"), "_value"),  # omegaconf (config/load.py)
    "_reconstruct": lambda: bool(importlib.import_module("megatron_lite.checkpoint.store")
                                 ._numpy_array_globals()),  # numpy (checkpoint/store.py)
    "_run_exitfuncs": lambda: hasattr(atexit, "_run_exitfuncs"),  # CPython (training/entry.py)
    # numpy 2's home of numpy.core (checkpoint/store.py reads either; one of them exists).
    "_core": lambda: hasattr(importlib.import_module("numpy"), "_core")
    or hasattr(importlib.import_module("numpy"), "core"),
    # Every thread's current frame, for the hang report (distributed/hang.py; in the sys docs).
    "_current_frames": lambda: callable(getattr(importlib.import_module("sys"), "_current_frames", None)),
    # torch's C extension and its c10d bindings, where the NCCL flight recorder's dump lives
    # (distributed/hang.py reads it with getattr: absent on builds without NCCL).
    "_C": lambda: hasattr(importlib.import_module("torch"), "_C"),
    "_distributed_c10d": lambda: hasattr(importlib.import_module("torch")._C, "_distributed_c10d"),
    "_dump_nccl_trace": lambda: not importlib.import_module("torch.distributed").is_nccl_available()
    or hasattr(importlib.import_module("torch")._C._distributed_c10d, "_dump_nccl_trace"),
    # Ray's draining-node list, as Ray Train's own preemption watcher reads it (launch/ray_control.py).
    "_private": lambda: callable(getattr(importlib.import_module("ray._private.state").state,
                                         "get_draining_nodes", None)),
}
ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")
# Private names of the package's own (set on objects of its own making; os._exit and
# NamedTuple._asdict are documented).
OURS = {"_runs_op_build_hook", "_asked_once", "_exit", "_asdict"}


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def private_names_used(path: Path) -> dict[str, int]:
    """{name: line} of every private attribute ``path`` reads or sets on something other than
    ``self`` or ``cls`` (``x._name``, or by string: ``getattr(x, "_name")`` and its kin), and of
    every private library module or name it imports."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found[node.attr] = node.lineno
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ACCESSORS
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and _private(node.args[1].value)
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found[node.args[1].value] = node.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            for alias in node.names:
                full = f"{module}.{alias.name}" if module else alias.name
                if full.startswith("megatron_lite") or full == "__future__.annotations":
                    continue
                if any(part.startswith("_") for part in full.split(".")):
                    found[full] = node.lineno
    return found


def test_every_private_name_the_package_uses_is_listed_and_only_the_adapter_uses_deepspeeds():
    listed = {name for _, name in RELIED_ON}
    unlisted, elsewhere = [], []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        for name, line in private_names_used(path).items():
            if name not in listed | set(OTHER_PRIVATE) | OURS:
                unlisted.append(f"{where}:{line} {name}")
            elif name in listed and where != "engine/internals.py":
                elsewhere.append(f"{where}:{line} {name}")
    assert not unlisted, "private names not in RELIED_ON (engine/internals.py):\n" + "\n".join(unlisted)
    assert not elsewhere, "RELIED_ON names used outside engine/internals.py:\n" + "\n".join(elsewhere)


@pytest.mark.parametrize("name", sorted(OTHER_PRIVATE))
def test_other_libraries_private_names_are_still_there(name):
    if name == "_private":  # Ray is optional (the Ray launcher's extra)
        pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    assert OTHER_PRIVATE[name](), name


def test_the_undocumented_engine_attributes_are_only_read_in_the_adapter():
    """Public-looking but undocumented engine attributes (``total_loss``, ``global_steps``, ...)
    are listed too: outside engine/internals.py, no module reads them from an engine."""
    listed = {name for _, name in RELIED_ON if not name.startswith("_")} - {"zero_grad", "start", "numel"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "engine/internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in listed \
                    and "engine" in ast.unparse(node.value):
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_deepspeed_zero_grad_still_only_drops_the_gradients():
    """``drop_gradients_from_a_list`` stands in for ``DeepSpeedEngine.zero_grad`` (ZeRO 0): the
    release's method must still do nothing but set every parameter's ``grad`` to None."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    body = ast.parse(textwrap.dedent(inspect.getsource(DeepSpeedEngine.zero_grad))).body[0].body
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert len(body) == 1 and isinstance(body[0], ast.For), ast.unparse(body[0])
    assert [ast.unparse(s) for s in body[0].body] == [f"{ast.unparse(body[0].target.elts[1])}.grad = None"], \
        "DeepSpeedEngine.zero_grad changed: update internals.drop_gradients_from_a_list"


def test_the_list_zero_grad_drops_every_gradient_tied_ones_too():
    from types import SimpleNamespace

    import torch

    from megatron_lite.engine.internals import drop_gradients_from_a_list

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
    model[1].weight = model[0].weight  # tied, as the output layer and the embedding
    engine = SimpleNamespace(module=model)
    drop_gradients_from_a_list(engine)
    model(torch.tensor([1, 2])).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_the_scan_sees_private_names_reached_by_string_and_not_our_own_attributes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch._dynamo\nfrom numpy import _core\n"
                     "def f(engine, self):\n    getattr(engine, '_norm', None)\n"
                     "    setattr(engine.x, '_y', 1)\n"
                     "    engine._z = 1\n    self._mine = 1\n    getattr(self, '_also_mine')\n")
    assert set(private_names_used(probe)) == {"torch._dynamo", "numpy._core", "_norm", "_y", "_z"}
