"""Will a recipe fit, and how fast will it run: ``python pretrain.py RECIPE --plan``."""

from megatron_lite.model.flops import parameter_counts
from megatron_lite.planner.estimate import Plan, estimate
from megatron_lite.planner.report import plan_report, suggest_report

__all__ = ["Plan", "estimate", "parameter_counts", "plan_report", "suggest_report"]
