#!/usr/bin/env python
"""Train a GPT- or Llama-style model from a recipe.

usage: python pretrain.py RECIPE.yaml [dotted.key=value ...] [--print-config | --dry-run | --plan [--suggest]]

  RECIPE.yaml         a recipe from recipes/ (or your own; 'base: other.yaml' extends another)
  dotted.key=value    overrides, applied after the recipe (e.g. training.iters=100 optimizer.lr=1e-3)
  --print-config      print the resolved config and exit
  --get KEY           print one resolved value (e.g. --get training.hpu_mode) and exit
                      (both with --world-size N [--gpus-per-node G]: first check the recipe's
                      layout for N ranks, G per node, as a launcher does before it starts them)
  --dry-run           build the model on the meta device, print parameters and FLOPs/token, exit
  --plan              print memory per device, FLOPs and step time for a machine, exit (1 when it
                      does not fit); with --world-size N (default: one node, or one model replica
                      when the global batch does not divide over a node), --gpus-per-node G
                      (default 4), --device NAME (A100-40GB, A100-80GB, H100, H200, Gaudi2, Gaudi3,
                      Max1550: an Aurora tile; default A100-40GB), --mfu X (default 0.4),
                      --host-memory-gb GB (a node's host memory, for offload; default: a typical
                      node for the device)
  --plan --suggest    list the layouts of the recipe's model that fit that machine, fastest first
                      by predicted step time (exit 1 when none fits)

Multi-process: torchrun --nproc-per-node N pretrain.py RECIPE ... (or launch/polaris.sh, gaudi.sh).
Exit status: 0 when the run finished as asked; otherwise non-zero with a one-line reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def main(argv: list[str]) -> int:
    # The DeepSpeed launcher appends --local_rank=N; the same value is in LOCAL_RANK.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    try:
        argv, values = _take_values(argv, VALUE_OPTIONS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flags = {a for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    unknown = flags - {"--help", "-h", "--print-config", "--dry-run", "--plan", "--suggest"}
    if "--help" in flags or "-h" in argv or not args:
        print(__doc__.strip())
        return 0 if ("--help" in flags or "-h" in argv) else 2
    if unknown:
        print(f"error: unknown option(s) {sorted(unknown)}; see --help", file=sys.stderr)
        return 2
    modes = {a for a in argv if a in ("--print-config", "--dry-run", "--plan")}
    if len(modes) > 1 or ("--suggest" in flags and "--plan" not in flags):
        given = " ".join(a for a in argv if a in ("--print-config", "--dry-run", "--plan", "--suggest"))
        print(f"error: {given}: give one of --print-config, --dry-run, --plan (--suggest goes with "
              "--plan); see --help", file=sys.stderr)
        return 2

    from megatron_lite.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args[0], args[1:])
    except ConfigError as e:
        from megatron_lite.training.entry import report_once

        report_once(e)
        return 2
    if "--world-size" in values and "--plan" not in flags:
        # A launcher's check before it queues or starts the ranks: the layout for that many.
        from megatron_lite.distributed import ParallelDims, TopologyError

        world = values["--world-size"]
        try:
            ParallelDims.plan(cfg, world, local_world_size=values.get("--gpus-per-node", world))
        except TopologyError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if "--print-config" in flags:
        print(to_yaml(cfg), end="")
        return 0
    if "--get" in values:
        value = cfg
        for part in values["--get"].split("."):
            if not hasattr(value, part):
                print(f"error: no key '{values['--get']}' in the config", file=sys.stderr)
                return 2
            value = getattr(value, part)
        print(value)
        return 0
    if "--dry-run" in flags:
        from megatron_lite.model import padding_note, padding_parameters
        from megatron_lite.training.run import describe_model

        try:
            model_cfg, params, fpt = describe_model(cfg)
        except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
            print(f"error: {e}", file=sys.stderr)
            return 1
        padding = padding_parameters(model_cfg, cfg.model.vocab_size)
        print(f"parameters: {params - padding:,}{padding_note(padding)}")
        print(f"flops_per_token: {fpt:.6e}  (training: 6N + 12·L·d·T, T={cfg.data.seq_length})")
        print(f"vocab_size: {model_cfg.vocab_size}")
        return 0

    if "--plan" in flags:
        return _plan(cfg, values, suggest="--suggest" in flags, recipe=args[0])

    # Habana's bridge reads PT_HPU_LAZY_MODE once, when it is imported, and since torch 2.5
    # `import torch` imports it (device autoload): the recipe's mode goes into the environment
    # before the first torch import (a launcher's export wins; select_accelerator refuses a
    # bridge already loaded in another mode).
    import os

    os.environ.setdefault("PT_HPU_LAZY_MODE", "1" if cfg.training.hpu_mode == "lazy" else "0")
    from megatron_lite.training.entry import train_to_exit_status

    return train_to_exit_status(cfg)


VALUE_OPTIONS = {"--world-size": int, "--gpus-per-node": int, "--device": str, "--mfu": float,
                "--host-memory-gb": float, "--get": str}
# What a value must be, and the fix when it is not: a plan from a negative world or an MFU of
# 4000% prints numbers that look like answers.
VALUE_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "--world-size": (lambda v: v >= 1, "give the number of devices, 1 or more"),
    "--gpus-per-node": (lambda v: v >= 1, "give the devices per node, 1 or more"),
    "--mfu": (lambda v: 0 < v <= 1, "give a fraction of the peak, above 0 and at most 1 (0.4 for 40%)"),
    "--host-memory-gb": (lambda v: v > 0, "give a node's host memory in GB, above 0"),
}


def _take_values(argv: list[str], options: dict) -> tuple[list[str], dict]:
    """Split ``--name VALUE`` / ``--name=VALUE`` options out of argv."""
    rest, values, i = [], {}, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in options:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                i += 1
                value = argv[i]
            try:
                values[name] = options[name](value)
            except ValueError:
                raise ValueError(f"{name} {value!r}: expected {options[name].__name__}") from None
            ok, fix = VALUE_RANGES.get(name, (lambda v: True, ""))
            if not ok(values[name]):
                raise ValueError(f"{name} {value}: {fix}")
        else:
            rest.append(argv[i])
        i += 1
    return rest, values


def _plan(cfg, values: dict, suggest: bool = False, recipe: str = "RECIPE") -> int:
    from megatron_lite.distributed import TopologyError
    from megatron_lite.planner import plan_report, suggest_report

    per_node = values.get("--gpus-per-node", 4)
    world = values.get("--world-size")
    if world is None:  # one node, or one model replica where a node's worth does not divide
        p = cfg.parallel
        replica = p.tensor * p.pipeline * p.ulysses
        world = per_node
        if per_node % replica or (cfg.training.global_batch_size or 0) % (
                cfg.training.micro_batch_size * (per_node // replica) or 1):
            world = replica
    device, mfu = values.get("--device", "A100-40GB"), values.get("--mfu", 0.4)
    tok = cfg.data.tokenizer
    if cfg.model.vocab_size is None and tok.model is not None:
        # A plan with a guessed vocabulary would size another model's embedding and loss: a
        # tokenizer that cannot be sized offline is refused, as --dry-run refuses it (exit 2,
        # since 1 means the plan does not fit).
        from megatron_lite.data.tokenizers import vocab_size_offline

        try:
            vocab_size_offline(tok.type, tok.model, tok.vocab_size)
        except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        if suggest:
            lines, fits = suggest_report(cfg, values.get("--world-size", per_node), per_node, device, mfu,
                                         recipe=recipe)
        else:
            lines, fits = plan_report(cfg, world, per_node, device, mfu, values.get("--host-memory-gb"))
    except (TopologyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    for note in _refused_here(cfg, lines, suggest):
        print(note)
    return 0 if fits else 1


def _refused_here(cfg, lines: list[str], suggest: bool) -> list[str]:
    """Notes on what this machine's DeepSpeed would refuse of the plan. A plan is often made on
    another machine than the one that trains (a login node, a laptop), so a note, not a failure."""
    import re

    from megatron_lite.engine.versions import pipeline_problem

    if suggest:  # the stages of the layouts listed
        stages = [int(n) for line in lines for n in re.findall(r"parallel\.pipeline=(\d+)", line)]
        problem = pipeline_problem(max(stages, default=1))
    else:
        problem = pipeline_problem(cfg.parallel.pipeline)
    if problem is None:
        return []
    which = "layouts with parallel.pipeline > 1 above" if suggest else "this layout"
    return [f"note: this machine's DeepSpeed refuses {which}: {problem}"]


if __name__ == "__main__":
    status = main(sys.argv[1:])
    from megatron_lite.training.entry import exit_process  # imports torch: only after main's

    exit_process(status)
