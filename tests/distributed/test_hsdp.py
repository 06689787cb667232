"""HSDP's traffic (``parallel.hsdp``): between shard groups ("nodes"), each rank's gradient shard
all-reduced over its replica group once per step (a piece per parameter, as ZeRO-3 writes them
during the backward pass), and nothing else on the accelerator.

Counted by ``bench/parallel_layouts.py``'s worker, which wraps every ``torch.distributed``
collective before DeepSpeed starts and records each call's group, operation and bytes.
"""

from __future__ import annotations

import importlib.util
import math

from megatron_lite.config import load_config
from megatron_lite.model import build_model, resolve_model
from tests.conftest import REPO, cpu_env

SMALL = ("model.d_model=64", "model.n_layers=2", "data.seq_length=64")


def _bench():
    spec = importlib.util.spec_from_file_location("parallel_layouts", REPO / "bench/parallel_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_replica_all_reduce_crosses_shard_groups():
    bench = _bench()
    # Counted from the fourth step: in its first steps ZeRO-3 checks over all ranks that they
    # fetch parameters in the same order (a broadcast per check), until its trace is complete.
    got = bench.launch("hsdp-2x2", steps=1, warmup=3, env=cpu_env(), extra=SMALL)  # rank 0's
    nodes = [{0, 1}, {2, 3}]
    crossing = {}
    for key, calls in got["counts"].items():
        kind = key.rsplit(" ", 1)[0]
        ranks = set(got["groups"].get(kind, []))
        if sum(bool(ranks & node) for node in nodes) > 1:
            crossing[key] = calls
    # Host control (stop flags, the spike check's loss) goes over the gloo control group.
    device = {k: v for k, v in crossing.items() if not k.startswith(("control ", "checkpoint "))}
    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*bench.MODEL, *SMALL])
    model = build_model(resolve_model(cfg.model, None, cfg.data.seq_length, 1), "meta")
    assert device == {"replica all_reduce": len(list(model.parameters()))}, crossing
    # Their size: rank 0's ZeRO-3 partition of every parameter, ceil(numel / 2) fp32 values each.
    shard_bytes = sum(math.ceil(p.numel() / 2) * 4 for p in model.parameters())
    assert got["bytes"]["replica all_reduce"] == shard_bytes
    # The rest of ZeRO-3 (gathers and gradient reduce-scatters) runs in the shard group.
    assert got["counts"].get("shard all_gather", 0) > 0 and got["counts"].get("shard reduce_scatter", 0) > 0
