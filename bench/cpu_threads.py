#!/usr/bin/env python
"""How a CPU's cores are best spent on a small model: one process's intra-op threads (what
``python pretrain.py`` does) against one worker per core, on the recipe's own model.

    python bench/cpu_threads.py recipes/shakespeare-char.yaml [--steps 50] [--rounds 3] [--cores W]
        [overrides]

Each case is a plain loop (forward, backward, clipping, torch AdamW) around the recipe's model
on random tokens, in fresh processes, after 10 warm-up steps; rounds alternate the cases.
With ``W`` the number of cores (``--cores``, by default the threads torch uses) and ``B`` the
micro-batch:

- ``threads``: one process, ``W`` threads, batch ``B`` (the baseline);
- ``one thread``: one process, one thread, batch ``B`` (how far the threads scale);
- ``per-core processes``: ``W`` processes at once, one thread and batch ``B/W`` each: the
  arithmetic of a data-parallel run with one rank per core (``torchrun --nproc-per-node W``),
  without its gradient all-reduce;
- ``gradient all-reduce``: that all-reduce alone (gloo, the model's gradient size, ``W``
  processes), what such a run adds to each step;
- ``per-core threads``: one process, ``W`` threads each taking ``B/W`` of the batch with one
  intra-op thread, the gradients accumulating into the same tensors.

Each line gives milliseconds per step (the slowest process's median) and baseline / case (above
1: faster than the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = ("threads", "one thread", "per-core processes", "gradient all-reduce", "per-core threads")


def worker(a: argparse.Namespace) -> None:
    """One process of one case; prints its median milliseconds per step as JSON."""
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(REPO))
    from megatron_lite.config import load_config
    from megatron_lite.model import build_model, resolve_model
    from megatron_lite.training.entry import exit_process

    cfg = load_config(a.recipe, a.overrides)
    seq = cfg.data.seq_length
    mcfg = resolve_model(cfg.model, cfg.data.tokenizer.vocab_size, seq)
    model = build_model(mcfg, seed=cfg.training.seed)
    grads = sum(p.numel() for p in model.parameters())
    dims = None
    if a.case == "gradient all-reduce":
        from megatron_lite.distributed import collectives, detect, init_distributed
        from megatron_lite.distributed.startup import shutdown_distributed

        # The run's own process groups (global batch: micro-batch × the ranks), as under torchrun.
        layout = ["training.device=cpu", "training.global_batch_size=null",
                  f"training.micro_batch_size={a.batch}"]
        run_cfg = load_config(a.recipe, [*a.overrides, *layout])
        dims, _ = init_distributed(run_cfg, detect())
        flat = torch.randn(grads)

        def step() -> None:  # over the data-parallel group, where DeepSpeed reduces gradients
            collectives.all_reduce(flat, dims.group("data"))
    else:
        o = cfg.optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                weight_decay=o.weight_decay)
        gen = torch.Generator().manual_seed(a.rank)
        x = torch.randint(0, mcfg.tokenizer_vocab_size, (a.batch, seq + 1), generator=gen)
        inputs, targets = x[:, :-1], x[:, 1:]
        parts = max(a.split, 1)
        pieces = list(zip(inputs.chunk(parts), targets.chunk(parts), strict=True))
        pool = None
        if parts > 1:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(parts, initializer=torch.set_num_threads, initargs=(1,))

        def piece(it: tuple[torch.Tensor, torch.Tensor]) -> None:
            (model(it[0], it[1]) / parts).backward()

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            if pool is None:
                piece(pieces[0])
            else:
                list(pool.map(piece, pieces))
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()

    for _ in range(10):
        step()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(a.steps // 5):
            step()
        times.append((time.perf_counter() - start) / (a.steps // 5) * 1000)
    print(json.dumps({"ms": statistics.median(times)}))
    if dims is not None:
        shutdown_distributed(dims)
    exit_process(0)  # past gloo's teardown abort at finalization (see its docstring)


def run_case(case: str, a: argparse.Namespace, cores: int, batch: int) -> float:
    """Milliseconds per step of ``case`` (the slowest of its processes)."""
    base = [sys.executable, __file__, a.recipe, "--worker", "--steps", str(a.steps), "--case", case]
    if case == "threads":
        commands = [[*base, "--threads", str(cores), "--batch", str(batch)]]
    elif case == "one thread":
        commands = [[*base, "--threads", "1", "--batch", str(batch)]]
    elif case == "per-core threads":
        commands = [[*base, "--threads", "1", "--batch", str(batch), "--split", str(cores)]]
    else:
        commands = [[*base, "--threads", "1", "--batch", str(batch // cores), "--rank", str(r)]
                    for r in range(cores)]
    ranks = {}
    if case == "gradient all-reduce":  # torchrun's variables, which the run's launch detection reads
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = {"WORLD_SIZE": str(cores), "LOCAL_WORLD_SIZE": str(cores), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"}
    procs = [subprocess.Popen([*c, *a.overrides], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": c[c.index("--threads") + 1], **ranks,
                                   **({"RANK": str(r), "LOCAL_RANK": str(r)} if ranks else {})})
             for r, c in enumerate(commands)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"case {case!r} failed")
    return max(json.loads(out.strip().splitlines()[-1])["ms"] for out in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="e.g. recipes/shakespeare-char.yaml")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cores", type=int, help="cores to share out (default: the threads torch uses)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--split", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="recipe overrides (dotted.key=value)")
    a = p.parse_intermixed_args()
    if a.worker:
        worker(a)
        return
    import torch

    sys.path.insert(0, str(REPO))
    from megatron_lite.config import load_config

    cores = a.cores or torch.get_num_threads()
    batch = load_config(a.recipe, a.overrides).training.micro_batch_size
    if cores < 2 or batch % cores:
        raise SystemExit(f"needs at least 2 cores and a micro-batch that they divide ({cores} cores, "
                         f"micro-batch {batch})")
    got: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(a.rounds):
        for case in CASES if r % 2 == 0 else reversed(CASES):
            got[case].append(run_case(case, a, cores, batch))
    baseline = statistics.median(got["threads"])
    print(f"{Path(a.recipe).name}: {cores} cores, micro-batch {batch}, {a.rounds} rounds of {a.steps} steps")
    for case in CASES:
        ms = statistics.median(got[case])
        rounds = " ".join(f"{v:.1f}" for v in got[case])
        print(f"  {case:<22} {ms:7.2f} ms/step (rounds {rounds}) | baseline / case {baseline / ms:.3f}")


if __name__ == "__main__":
    main()
