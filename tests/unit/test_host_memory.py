"""training.cpu_retain_freed_memory: freed host memory is reused, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cpu_env

# In a fresh process (the setting is process-wide and cannot be undone): start the trainer's
# distributed setup with the flag, then allocate and free 32 MiB tensors, as a training step's
# activations come and go, and count the page faults once the first rounds have warmed up.
WORKER = """
import resource, sys, torch
from megatron_lite.config.schema import Config, DataConfig, TokenizerConfig, TrainingConfig
from megatron_lite.distributed import detect, init_distributed
cfg = Config(data=DataConfig(prefix="unused", tokenizer=TokenizerConfig(model="unused")),
             training=TrainingConfig(device="cpu", cpu_retain_freed_memory=sys.argv[1] == "true"))
init_distributed(cfg, detect())
def step():
    for _ in range(4):
        x = torch.ones(8 << 20)
        y = x * 2
        del x, y
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(flag: str) -> int:
    out = subprocess.run([sys.executable, "-c", WORKER, flag], cwd=REPO, env=cpu_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


def test_freed_memory_is_reused_instead_of_faulted_in_again():
    probe = subprocess.run([sys.executable, "-c", "from megatron_lite.distributed.device import "
                            "retain_freed_host_memory as r; print(r())"], cwd=REPO, env=cpu_env(),
                           capture_output=True, text=True, timeout=120)
    if probe.stdout.strip() != "True":
        pytest.skip("not glibc: the setting applies to glibc's allocator only")
    # 5 steps of 2 x 4 x 32 MiB: every page faulted in anew without the setting (~330,000
    # faults); with it, none, or at most one late heap growth (8,192 faults).
    without, with_ = _faults("false"), _faults("true")
    assert without > 160_000
    assert with_ < without / 20

