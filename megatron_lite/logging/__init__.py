"""Console, metrics.jsonl, TensorBoard and W&B logging."""

from megatron_lite.logging.metrics import MetricsLogger, console_line

__all__ = ["MetricsLogger", "console_line"]
