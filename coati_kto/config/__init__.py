"""Configuration: the schema (``schema``), loading with overrides and one-line errors (``load``), and discovery
of every key for ``coati-kto config --schema`` (``discovery``).

The lowest layer with project imports: may import ``coati_kto.errors`` and ``coati_kto.families`` only. The
names below are the public surface (recipes and the seeds import them from here).
"""

from coati_kto.config.load import load_config, parse_overrides, save_config
from coati_kto.config.schema import (
    Config,
    DataSection,
    KTOSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    OutputSection,
    PluginSection,
    TrainSection,
)

__all__ = [
    "Config",
    "DataSection",
    "KTOSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "OutputSection",
    "PluginSection",
    "TrainSection",
    "load_config",
    "parse_overrides",
    "save_config",
]
