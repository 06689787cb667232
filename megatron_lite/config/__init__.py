"""Recipe schema, loading and validation."""

from megatron_lite.config.load import ConfigError, load_config, to_yaml
from megatron_lite.config.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "to_yaml"]
