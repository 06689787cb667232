"""The ``built`` entries of ``RELIED_ON`` (engine/internals.py): the attributes the project reads
or sets on DeepSpeed's engines, optimizers and parameters exist on real ones of every kind it
runs, built and stepped by relied_on_worker.py in two processes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, _free_port, cpu_env

# The optimizer DeepSpeed wraps the torch optimizer in, per kind: the kinds are what they claim.
OPTIMIZERS = {"fp32": "AdamW", "bf16": "FP16_UnfusedOptimizer", "zero1": "DeepSpeedZeroOptimizer",
              "zero3": "DeepSpeedZeroOptimizer_Stage3", "pipe": "AdamW", "pipe_bf16": "BF16_Optimizer"}


def test_every_attribute_relied_on_exists_on_real_engines_optimizers_and_parameters(tmp_path):
    out = tmp_path / "report.json"
    # One name no object has: the check reports what is missing, by its entry.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(_free_port()), "tests/distributed/relied_on_worker.py",
                           str(out), "built zero3.engine.optimizer", "no_such_attribute"],
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["optimizers"] == OPTIMIZERS
    assert report["missing"] == ["built zero3.engine.optimizer: no 'no_such_attribute'"], report["missing"]
