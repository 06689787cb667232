"""megatron_lite: config-driven, Megatron-style LLM pretraining on DeepSpeed."""

__version__ = "0.1.0"
