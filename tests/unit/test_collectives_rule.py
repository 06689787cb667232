"""The one rule of distributed/collectives.py, checked on the source: no other file of the
project calls torch.distributed's collectives, and only ParallelDims creates process groups.
Also the helpers' answers where torch.distributed was never started."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_lite.distributed import collectives
from megatron_lite.distributed.parallel_dims import ParallelDims
from tests.conftest import REPO

COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter_single", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
    "isend", "irecv", "barrier", "monitored_barrier", "broadcast_object_list", "all_gather_object",
    "gather_object", "scatter_object_list", "batch_isend_irecv",
}
GROUP_MAKERS = {"new_group", "new_subgroups", "init_process_group", "init_distributed"}


def _sources() -> list[Path]:
    files = [REPO / "pretrain.py", *(REPO / "megatron_lite").rglob("*.py"), *(REPO / "tools").rglob("*.py"),
             *(REPO / "bench").rglob("*.py")]
    return [f for f in files if f.is_file()]


def _calls(path: Path) -> list[tuple[str, int]]:
    """Attribute calls ``X.name(...)`` with ``name`` a collective or a group maker."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in COLLECTIVES | GROUP_MAKERS:
                base = ast.unparse(node.func.value)
                if base in ("dist", "torch.distributed", "deepspeed", "deepspeed.comm"):
                    out.append((node.func.attr, node.lineno))
    return out


def test_only_collectives_py_calls_collectives_and_only_parallel_dims_makes_groups():
    """(The default group is started in startup.py, every other group made in parallel_dims.py.)"""
    owners = {"collectives": REPO / "megatron_lite/distributed/collectives.py",
              "groups": REPO / "megatron_lite/distributed/parallel_dims.py",
              "start": REPO / "megatron_lite/distributed/startup.py"}
    found = {f: _calls(f) for f in _sources()}
    assert any(name == "all_reduce" for name, _ in found[owners["collectives"]])  # the scan sees calls
    stray = [f"{f.relative_to(REPO)}:{line}: {name}" for f, calls in found.items() for name, line in calls
             if not ((name in COLLECTIVES and f == owners["collectives"])
                     or (name in GROUP_MAKERS and f == owners["groups"])
                     or (name in ("init_process_group", "init_distributed") and f == owners["start"]))]
    assert not stray, "collectives or process groups outside their module:\n" + "\n".join(stray)


def test_without_torch_distributed_the_helpers_answer_locally():
    dims = ParallelDims(world_size=1, rank=0, local_rank=0, tensor=1, pipeline=1, data=1)
    assert collectives.any_rank([True, False], dims) == [True, False]
    assert collectives.sum_over_ranks([1.5, 2.0], dims, "x") == [1.5, 2.0]
    assert collectives.mean_over_ranks(3.0, dims, "x") == 3.0
    assert collectives.broadcast_object({"a": 1}, dims, "x") == {"a": 1}
    assert collectives.all_gather_object(7, dims, "x") == [7]
    ran = []
    collectives.on_one_rank_then_all(lambda: ran.append(1), dims, "x")
    assert ran == [1]
    with pytest.raises(OSError, match="disk"):
        collectives.on_every_rank(lambda: (_ for _ in ()).throw(OSError("disk")), dims, "x")


def test_a_backend_error_line_loses_its_source_location():
    e = RuntimeError("[/src/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv\nmore")
    assert collectives.first_line(e) == "Timed out waiting 3000ms for recv"
    assert collectives.first_line(RuntimeError()) == "RuntimeError"
    assert torch.distributed.is_available()


def test_the_other_ranks_raise_the_failing_ranks_error_kind_by_name():
    """raise_together sends the failing rank's exception class by name (a class defined in a
    function cannot be pickled, and failing to pickle it would stop one rank mid-collective)."""
    from megatron_lite.checkpoint.store import CheckpointError
    from megatron_lite.distributed.collectives import _same_kind

    class Local(Exception):
        pass

    made = _same_kind(CheckpointError.__module__, CheckpointError.__qualname__, "rank 0 failed")
    assert type(made) is CheckpointError and str(made) == "rank 0 failed"
    made = _same_kind(Local.__module__, Local.__qualname__, "rank 1 failed")
    assert type(made) is RuntimeError and str(made) == "rank 1 failed"
