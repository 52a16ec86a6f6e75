"""The backend's configuration: which recipe, which sites to rewrite, per-module overrides.

``schema.py`` holds the frozen dataclasses (what each setting means and trades); ``loading.py`` turns
``torch.compile`` options and TOML files into them, reporting every mistake with its source and key
path. Users, docs and tests import both from here.
"""

from .loading import config_argument, config_from_dict, load_config, resolve_config
from .schema import (ConfigError, DistributedConfig, InferenceConfig, MemoryConfig, Override, RewriteConfig,
                     TeConfig)

__all__ = [
    "ConfigError",
    "RewriteConfig",
    "Override",
    "DistributedConfig",
    "InferenceConfig",
    "MemoryConfig",
    "TeConfig",
    "load_config",
    "config_from_dict",
    "resolve_config",
    "config_argument",
]
