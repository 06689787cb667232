#!/usr/bin/env python
"""Step time and collectives of each parallel layout, against one process in the same invocation.

For a small Llama-style model on random tokens (same global batch everywhere), every layout is
launched with torchrun; each measures its mean step time after warm-up and counts the
collectives its ranks issue per step (calls and bytes, by operation and by process group:
tensor, ulysses, data, pipeline p2p, HSDP's shard and replica groups, the host control
groups). The table shows the time relative to the single process and, where the count follows
from the model alone, the theoretical count next to the measured. Accelerator groups are named
by their ranks (the first of tensor, ulysses, pipeline, data, data+ulysses, shard, replica with
those ranks; "self" for a group of one rank, which still costs a call); the gloo groups of host
control ("control", "checkpoint") by what they are.

    python bench/parallel_layouts.py [--layouts tp2 tp2-sp ulysses2 pp2 dp2-zero1 ...] [--steps 6]

On CPU the ranks share the machine's cores, so the ratios show communication overhead, not
speed-up. On a GPU machine run it with DS_ACCELERATOR unset and training.device=cuda.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYERS = 4
MODEL = [f"model.n_layers={LAYERS}", "model.n_heads=8", "model.n_kv_heads=4", "model.d_model=256",
         "model.vocab_size=512", "model.position=rope", "model.norm=rmsnorm", "model.activation=swiglu",
         "model.bias=false", "model.tie_embeddings=false", "data.seq_length=256",
         "training.micro_batch_size=4", "training.global_batch_size=16", "training.iters=100"]
LAYOUTS = {
    "single": (1, []),
    "tp2": (2, ["parallel.tensor=2"]),
    "tp2-sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "ulysses2": (2, ["parallel.ulysses=2"]),
    "context2": (2, ["parallel.context=2"]),
    "pp2": (2, ["parallel.pipeline=2", "parallel.zero_stage=1"]),
    "dp2-zero0": (2, []),
    "dp2-zero1": (2, ["parallel.zero_stage=1"]),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "tp2xpp2": (4, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.zero_stage=1"]),
    "hsdp-2x2": (4, ["parallel.hsdp=true", "parallel.hsdp_shard_size=2"]),
    "dp2-zero2-offload": (2, ["parallel.zero_stage=2", "parallel.offload_optimizer=cpu"]),
    "dp2-zero3-tile2": (2, ["parallel.zero_stage=3", "parallel.tile_factor=2"]),
}


def theoretical(layout: str, micro_batches: int) -> dict[str, int]:
    """Collectives per step that the model's structure fixes (per rank)."""
    L, m = LAYERS, micro_batches
    if layout == "tp2":
        # forward: one all-reduce leaving attention and one leaving the MLP per layer, one after
        # the vocabulary-parallel embedding, two in the cross-entropy (row max; target logit and
        # sum of exponentials); backward: one entering attention and the MLP per layer, one
        # entering the output layer; once per step, the gradient norm's sum over the slices.
        return {"tensor all_reduce": m * (2 * L + 1 + 2 + 2 * L + 1) + 1}
    if layout == "tp2-sp":
        # all-gather into / reduce-scatter out of each sub-layer, mirrored in the backward, plus
        # the output layer's gather and the backward of the scatter after the embedding; the
        # embedding's and the cross-entropy's all-reduces, the gradient sums of the norms (2 per
        # layer + the final one) and once per step the gradient norm.
        return {"tensor all_gather": m * (2 * L + 1 + 2 * L + 1), "tensor reduce_scatter": m * (4 * L + 1),
                "tensor all_reduce": m * (1 + 2 + 2 * L + 1) + 1}
    if layout == "pp2":
        # the first stage sends each micro-batch's activations and receives their gradients.
        return {"pipeline p2p send": m, "pipeline p2p recv": m}
    if layout == "hsdp-2x2":
        # Between the two shard groups: one all-reduce of each rank's gradient shard over its
        # replica group; everything else of ZeRO-3 stays in the shard group.
        return {"replica all_reduce": 1}
    if layout == "context2":
        # Ring attention on 2 ranks, per layer: forward one exchange of keys and values, backward
        # one more and two of their gradients; each exchange one isend and one irecv.
        return {"context p2p isend": m * 4 * L, "context p2p irecv": m * 4 * L}
    if layout == "ulysses2":
        # q, k, v and the output: four all-to-alls per layer forward, four backward; the loss's
        # sum over the sequence slices, and (same two ranks here) the gradient all-reduce.
        return {"ulysses all_to_all": m * 8 * L, "ulysses all_reduce": m + 1}
    return {}


# ---------------------------------------------------------------- worker (one rank)
def worker(out: str, steps: int, warmup: int, layout: str, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from megatron_lite.config import load_config
    from megatron_lite.data.gpt_dataset import GlobalBatchSampler
    from megatron_lite.distributed import collectives, detect, init_distributed
    from megatron_lite.training.build import build

    counts: Counter = Counter()
    volume: Counter = Counter()
    counting = [False]
    inside = [0]
    names: dict[tuple[int, ...], str] = {}
    host_groups: dict[int, str] = {}
    group_ranks: dict[str, list[int]] = {}

    def counted(op: str, fn):
        def wrapper(*args, **kwargs):
            if counting[0] and not inside[0]:
                group = kwargs.get("group")
                ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
                if op in ("send", "recv", "isend", "irecv"):
                    # Ring attention passes its group (batch_isend_irecv); DeepSpeed's pipeline
                    # sends without one.
                    kind = f"{names[ranks]} p2p" if ranks in names else "pipeline p2p"
                else:
                    kind = host_groups.get(id(group)) or names.get(ranks, "world" if group is None
                                                                   else f"ranks{list(ranks)}")
                    group_ranks[kind] = list(ranks or range(dist.get_world_size()))
                given = [*args, kwargs.get("tensor"), kwargs.get("input"), kwargs.get("input_tensor")]
                tensor = next((t for t in given if isinstance(t, torch.Tensor)), None)
                if op in ("all_gather", "all_to_all") and len(args) > 1 and isinstance(args[1], torch.Tensor):
                    tensor = args[1]  # (output, input): count what this rank sends
                key = f"{kind} {op}"
                counts[key] += 1
                if isinstance(tensor, torch.Tensor):
                    volume[key] += tensor.numel() * tensor.element_size()
            inside[0] += 1  # torch's send is isend + wait: count the outer call only
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] -= 1
        return wrapper

    # Wrapped before DeepSpeed starts: its communication backend keeps references to these.
    for op, attr in [("all_reduce", "all_reduce"), ("all_gather", "all_gather_into_tensor"),
                     ("reduce_scatter", "reduce_scatter_tensor"), ("all_to_all", "all_to_all_single"),
                     ("broadcast", "broadcast"), ("send", "send"), ("recv", "recv"), ("isend", "isend"),
                     ("irecv", "irecv"), ("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter")]:
        wrapped = counted(op, getattr(dist, attr))
        # DeepSpeed's coalesced gathers call distributed_c10d's functions directly.
        for namespace in (dist, dist.distributed_c10d):
            setattr(namespace, attr, wrapped)

    cfg = load_config(REPO / "recipes/shakespeare-char.yaml", [*MODEL, *overrides])
    dims, acc = init_distributed(cfg, detect())
    for label, axes in [("tensor", ("tensor",)), ("ulysses", ("ulysses",)), ("context", ("context",)),
                        ("pipeline", ("pipeline",)),
                        ("data", ("data",)), ("data+ulysses", ("ulysses", "data")),
                        ("tensor+pipeline", ("tensor", "pipeline"))]:
        for ranks in dims.group_ranks(axes):
            # The first name wins where two dimensions have the same ranks.
            names.setdefault(tuple(ranks), label if len(ranks) > 1 else "self")
    if dims.hsdp_shard_size:
        for label, all_ranks in zip(("shard", "replica"), dims.hsdp_group_ranks(), strict=True):
            for ranks in all_ranks:
                names.setdefault(tuple(ranks), label if len(ranks) > 1 else "self")
    for label in ("control", "checkpoint"):
        host_groups[id(dims.group(label))] = label
    parts = build(cfg, dims, acc, None, 100)
    runner, device = parts.step_runner(), parts.device
    data = torch.randint(0, 512, (4096, cfg.data.seq_length + 1), generator=torch.Generator().manual_seed(0))
    sampler = GlobalBatchSampler(0, dims.global_batch(cfg), cfg.training.micro_batch_size, dims.dp_rank,
                                 dims.data, wrap=len(data))
    batches = (data[idx] for idx in sampler)

    for _ in range(warmup):
        runner.train_step(batches, device)
    collectives.barrier(dims, "the start of the timed steps")
    counting[0] = True
    start = time.perf_counter()
    for _ in range(steps):
        runner.train_step(batches, device)
    collectives.barrier(dims, "the end of the timed steps")
    seconds = (time.perf_counter() - start) / steps
    counting[0] = False
    if dims.rank == 0:
        Path(out).write_text(json.dumps({
            "step_s": seconds, "micro_batches": runner.grad_accum,
            "counts": {k: v / steps for k, v in counts.items()}, "groups": group_ranks,
            "bytes": {k: v / steps for k, v in volume.items()},
            "mib": {k: v / steps / 2**20 for k, v in volume.items()}}))


# ---------------------------------------------------------------- driver
def launch(layout: str, steps: int, warmup: int, env: dict[str, str] | None = None,
           extra: tuple[str, ...] = ()) -> dict:
    """Run ``layout`` under torchrun; ``env``: the ranks' environment (default: this one's);
    ``extra``: overrides of the model above."""
    nproc, overrides = LAYOUTS[layout]
    overrides = [*overrides, *extra]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        me = [str(Path(__file__).resolve()), "--worker", out, "--steps", str(steps), "--warmup", str(warmup),
              "--layouts", layout, "--", *overrides]
        if nproc == 1:
            cmd = [sys.executable, *me]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(29000 + os.getpid() % 1000), *me]
        env = dict(env or {**os.environ, "PYTHONPATH": str(REPO)})
        env.setdefault("DS_ACCELERATOR", "cpu")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{layout} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=[k for k in LAYOUTS if k != "single"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.warmup, a.layouts[0], a.overrides)
        return
    base = launch("single", a.steps, a.warmup)
    print(f"single process: {base['step_s'] * 1000:.0f} ms/step ({base['micro_batches']} micro-batches)")
    print(f"{'layout':<10} {'ranks':>5} {'time/single':>11}  collectives per step (measured | theory): "
          "MiB handed to them")
    for layout in a.layouts:
        r = launch(layout, a.steps, a.warmup)
        theory = theoretical(layout, r["micro_batches"])
        parts = []
        for key in sorted(r["counts"]):
            expect = f" | {theory[key]}" if key in theory else ""
            parts.append(f"{key} {r['counts'][key]:g}{expect}: {r['mib'].get(key, 0):.2f}")
        ratio = r["step_s"] / base["step_s"]
        print(f"{layout:<10} {LAYOUTS[layout][0]:>5} {ratio:>11.2f}  " + "; ".join(parts))


if __name__ == "__main__":
    main()
