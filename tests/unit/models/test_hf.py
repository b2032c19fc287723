"""GPU-only model options fail as one clear config line where their package is missing (any machine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from coati_kto.config.schema import ModelSection
from coati_kto.errors import ConfigError
from coati_kto.models.hf import load_causal_lm


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_2_without_flash_attn_is_a_config_error(tiny_model_dir: Path) -> None:
    """Before: transformers' multi-line ImportError (a traceback from the CLI), seen on an H100 without flash-attn."""
    section = ModelSection(path=str(tiny_model_dir), attn_implementation="flash_attention_2")
    with pytest.raises(
        ConfigError, match=r"^model\.attn_implementation flash_attention_2 needs the flash-attn"
    ):
        load_causal_lm(section.path, section, torch.float32)
