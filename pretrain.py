#!/usr/bin/env python
"""Train a GPT- or Llama-style model from a recipe.

usage: python pretrain.py RECIPE.yaml [dotted.key=value ...] [--print-config | --dry-run]

  RECIPE.yaml         a recipe from recipes/ (or your own; 'base: other.yaml' extends another)
  dotted.key=value    overrides, applied after the recipe (e.g. training.iters=100 optimizer.lr=1e-3)
  --print-config      print the resolved config and exit
  --dry-run           build the model on the meta device, print parameters and FLOPs/token, exit

Multi-process: torchrun --nproc-per-node N pretrain.py RECIPE ... (or launch/polaris.sh, gaudi.sh).
Exit status: 0 when the run finished as asked; otherwise non-zero with a one-line reason.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    # The DeepSpeed launcher appends --local_rank=N; the same value is in LOCAL_RANK.
    argv = [a for a in argv if not a.startswith(("--local_rank", "--local-rank"))]
    flags = {a for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    unknown = flags - {"--help", "-h", "--print-config", "--dry-run"}
    if "--help" in flags or "-h" in argv or not args:
        print(__doc__.strip())
        return 0 if ("--help" in flags or "-h" in argv) else 2
    if unknown:
        print(f"error: unknown option(s) {sorted(unknown)}; see --help", file=sys.stderr)
        return 2

    from megatron_lite.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args[0], args[1:])
    except ConfigError as e:
        _report_once(e)
        return 2
    if "--print-config" in flags:
        print(to_yaml(cfg), end="")
        return 0
    if "--dry-run" in flags:
        from megatron_lite.training.run import describe_model

        try:
            model_cfg, params, fpt = describe_model(cfg)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"parameters: {params:,}")
        print(f"flops_per_token: {fpt:.6e}  (training: 6N + 12·L·d·T, T={cfg.data.seq_length})")
        print(f"vocab_size: {model_cfg.vocab_size}")
        return 0

    from megatron_lite.checkpoint import CheckpointError
    from megatron_lite.distributed import TopologyError
    from megatron_lite.spikes import SpikeStop
    from megatron_lite.training.run import run

    try:
        run(cfg)
    except TopologyError as e:
        _report_once(e)
        return 2
    except (FileNotFoundError, ValueError, CheckpointError, SpikeStop) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _report_once(error: Exception) -> None:
    """A recipe or layout error is the same on every rank: print it from the first rank only."""
    from megatron_lite.distributed import detect

    if detect().rank == 0:
        print(f"error: {error}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
