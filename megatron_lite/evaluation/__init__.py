"""Downstream evaluation: lm-evaluation-harness tasks on checkpoints and during training (the
``eval`` extra; importing this package needs none of it)."""

from __future__ import annotations

from megatron_lite.evaluation.harness import (
    INSTALL_HINT,
    MissingExtraError,
    UnknownTaskError,
    adapter_class,
    checkpoint_tokenizer,
    evaluate_tasks,
    flat_metrics,
    harness_lm,
    load_checkpoint,
    run_tasks,
)

__all__ = [
    "INSTALL_HINT", "MissingExtraError", "UnknownTaskError", "adapter_class", "checkpoint_tokenizer",
    "evaluate_tasks", "flat_metrics", "harness_lm", "load_checkpoint", "run_tasks",
]
