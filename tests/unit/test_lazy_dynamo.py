"""The tests' start-up shortcut (tests/dist_harness/lazy_dynamo.py) keeps what torch does: a
function under ``torch.compile`` is still traced by TorchDynamo (at its first call, not at its
decoration), ``torch.compiler.disable`` still keeps TorchDynamo out once it is there; and what it
is for holds: DeepSpeed's ZeRO optimizer check, which imports a module that compiles a function,
and ZeRO-3's hooks no longer import TorchDynamo in a process that never traces."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, cpu_env

PROBE = """
import sys
import torch

assert torch.compile.__module__ == "tests.dist_harness.lazy_dynamo", torch.compile
try:  # DeepSpeed's ZeRO optimizer check imports it (releases with a Muon optimizer)
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
except ImportError:
    pass
import deepspeed.runtime.zero.parameter_offload  # noqa: F401  (ZeRO-3's hooks)


@torch.compile(backend="eager")
def double(x):
    return x * 2


@torch.compiler.disable
def plus_one(x):
    return x + 1


x = torch.arange(3.0)
assert plus_one(x).tolist() == [1.0, 2.0, 3.0]
print("before the first call:", "torch._dynamo" in sys.modules)
assert double(x).tolist() == [0.0, 2.0, 4.0]
from torch._dynamo.utils import counters

print("graphs:", counters["stats"]["unique_graphs"])


@torch.compile(backend="eager")
def calls_disabled(x):
    return plus_one(x) * 3


counters.clear()
assert calls_disabled(x).tolist() == [3.0, 6.0, 9.0]
print("graph breaks:", sum(counters["graph_break"].values()))
"""


def test_compile_traces_at_the_first_call_and_zero_imports_no_compiler():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=cpu_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "before the first call: False" in lines, out.stdout
    assert "graphs: 1" in lines, out.stdout
    # The disabled function is not traced: the compiled caller breaks its graph there.
    breaks = [int(line.split()[-1]) for line in lines if line.startswith("graph breaks:")]
    assert breaks and breaks[0] >= 1, out.stdout
