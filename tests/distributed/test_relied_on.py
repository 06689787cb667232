"""The ``built`` entries of ``RELIED_ON`` (engine/internals.py): the attributes the project reads
or sets on DeepSpeed's engines, optimizers and parameters exist on real ones of every kind it
runs, built and stepped by relied_on_worker.py in two processes (once for the module)."""

from __future__ import annotations

import json
import subprocess

import pytest

from megatron_lite.engine.internals import RELIED_ON
from tests.conftest import REPO, cpu_env, launch_ranks

BUILT = [(where, name) for where, name in RELIED_ON if where.startswith("built ")]
# The optimizer DeepSpeed wraps the torch optimizer in, per kind: the kinds are what they claim.
# (bf16 at ZeRO 0: FP16_UnfusedOptimizer in newer releases, BF16_Optimizer in 0.16.)
OPTIMIZERS = {"fp32": {"AdamW"}, "bf16": {"FP16_UnfusedOptimizer", "BF16_Optimizer"},
              "zero1": {"DeepSpeedZeroOptimizer"}, "zero3": {"DeepSpeedZeroOptimizer_Stage3"},
              "pipe": {"AdamW"}, "pipe_bf16": {"BF16_Optimizer"}}
ABSENT = ("built zero3.engine.optimizer", "no_such_attribute")
"""A name no object has, checked with the others: the check reports what is missing, by entry."""


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("relied_on") / "report.json"
    proc = subprocess.run([*launch_ranks(2), "tests/distributed/relied_on_worker.py", str(out), *ABSENT],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("where, name", BUILT, ids=[f"{w[6:]}:{n}" for w, n in BUILT])
def test_relied_on_attribute_exists_on_a_real_object(report, where, name):
    root = where[6:].split(".")[0]
    if root in report["not_built"]:
        why = {"unfused": f"{report['optimizers']['bf16']} for bf16 at ZeRO 0",
               "pipe_bf16_prologue": "its bf16 optimizer has no backward_prologue before 0.18.3"}[root]
        pytest.skip(f"this DeepSpeed builds no '{root}' object ({why}): the names are read only where "
                    "it does")
    assert not [m for m in report["missing"] if m.startswith(f"{where}: no '{name}'")
                or m.startswith(f"{where} (not reached")], \
        f"{where[6:]} no longer has '{name}': update engine/internals.py"


def test_each_kind_of_engine_is_the_kind_it_claims(report):
    assert report["optimizers"].keys() == OPTIMIZERS.keys()
    assert all(report["optimizers"][k] in OPTIMIZERS[k] for k in OPTIMIZERS), report["optimizers"]


def test_a_name_no_object_has_is_reported_by_its_entry(report):
    assert report["missing"] == [f"{ABSENT[0]}: no '{ABSENT[1]}'"], report["missing"]
