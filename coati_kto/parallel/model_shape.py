"""A causal LM's shape from its config.json alone: parameter counts by how tensor parallelism splits them.

``model_shape(source)`` reads config.json (a local directory, or a Hub id already in the hub cache), builds the
model class on the meta device (no weights read, no memory taken) and counts its parameters exactly, each tied
tensor once. It sorts them the way the hybrid_parallel plugin's shardformer splits them: the vocabulary rows
(embeddings and an untied LM head, padded to a multiple of 64 x tp_size and split by rows), the decoder layers'
projections (split by tp_size) and what every tensor-parallel rank keeps whole (norms, routers' biases).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coati_kto.config.hub import hub_id
from coati_kto.errors import ConfigError

VOCAB_MULTIPLE = 64  # HybridParallelPlugin's make_vocab_size_divisible_by
VOCAB_NAMES = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings", "embed_in")


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan reads of a model: its sizes and its parameters sorted by tensor-parallel split."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vocab_params: int  # embeddings and an untied head: vocab x hidden each
    split_params: int  # the decoder layers' projections (and their biases): 1/tp each
    whole_params: int  # norms and the like: whole on every tensor-parallel rank
    lora_linears: tuple[tuple[str, int, int], ...]  # (module suffix, in, out) of every Linear in the layers
    outer_whole_params: int = 0  # of whole_params, those outside the decoder layers (the final norm)

    @property
    def params(self) -> int:
        """Every parameter, each tied tensor once."""
        return self.vocab_params + self.split_params + self.whole_params

    def params_per_rank(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds: vocabulary rows padded to 64 x tp and split, projections
        split (rounded up), the rest whole."""
        vocab_tensors = self.vocab_params // max(1, self.vocab * self.hidden)
        rows = self.vocab if tp == 1 else math.ceil(self.vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
        vocab = vocab_tensors * rows // tp * self.hidden
        return vocab + math.ceil(self.split_params / tp) + self.whole_params

    def stage_params(self, tp: int, layers: int, first: bool, last: bool) -> int:
        """Parameters one rank of a pipeline stage holds: ``layers`` decoder layers (their share of the split and
        whole parameters), the embedding on the first stage, the final norm and the LM head on the last (a tied
        embedding on both); split by tensor parallelism as :meth:`params_per_rank`."""
        vocab_tensors = self.vocab_params // max(1, self.vocab * self.hidden)
        rows = self.vocab if tp == 1 else math.ceil(self.vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
        held = ((max(vocab_tensors - 1, 1) if first else 0) + (1 if last else 0)) if vocab_tensors else 0
        vocab = held * rows // tp * self.hidden
        split = math.ceil(self.split_params * layers / self.layers / tp)
        whole = (self.whole_params - self.outer_whole_params) * layers // self.layers
        return vocab + split + whole + (self.outer_whole_params if last else 0)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: r x (in + out) for every Linear whose name ends with one of ``targets``."""
        return sum(rank * (i + o) for name, i, o in self.lora_linears if name in targets)


def read_config_json(source: str, key: str = "model.path") -> dict[str, Any]:
    """config.json of a local directory, or of a Hub id from the hub cache (no download): ConfigError one line
    when there is none."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{key}: {source} has no config.json (the plan reads the model's shape from it)"
            )
        return _parse(path, key)
    if hub_id(source) is None:
        raise ConfigError(f"{key}: {source} does not exist (a local directory, or a hub id like org/name)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json")
    if not isinstance(cached, str):
        raise ConfigError(
            f"{key}: {source} is not in the hub cache (the plan reads only config.json: download it with "
            f"`hf download {source} config.json`, or set {key} to a directory holding it)"
        )
    return _parse(Path(cached), key)


def _parse(path: Path, key: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {path}: not a JSON config ({err})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{key}: {path}: no model_type (not a transformers config.json)")
    return raw


def model_shape(source: str, key: str = "model.path") -> ModelShape:
    """The shape of the model config.json describes (module docstring); ConfigError one line for a config
    transformers cannot build."""
    raw = read_config_json(source, key)
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from coati_kto.families import auto_model_class

    if raw["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(
            f"{key}: {source}: model_type {raw['model_type']!r} is not one this transformers knows"
        )
    # Any failure of transformers' own code on this config is one line, not a traceback.
    try:
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
    except Exception as err:
        why = (
            " ".join(str(err).split())[:300] or type(err).__name__
        )  # one line, however long transformers' is
        raise ConfigError(f"{key}: {source}: transformers cannot build its config.json ({why})") from None
    # A config without one hidden size or head count (Gemma 4's per-layer head_dim): one line too.
    try:
        return _count(model, config.get_text_config())
    except Exception as err:
        raise ConfigError(
            f"{key}: {source}: the plan reads no single decoder shape from it ({err})"
        ) from None


def _count(model: Any, text: Any) -> ModelShape:
    """The shape of the meta ``model`` (``text``: its text config)."""
    from torch import nn

    counts = {"vocab": 0, "split": 0, "whole": 0, "outer": 0}
    for name, param in model.named_parameters():  # each tied tensor once
        leaf = name.rsplit(".", 2)[-2] if "." in name else name
        if leaf in VOCAB_NAMES:
            counts["vocab"] += param.numel()
        elif ".layers." in name and "norm" not in name and param.dim() >= 1 and "gate.weight" not in name:
            counts["split"] += param.numel()
        else:
            counts["whole"] += param.numel()
            counts["outer"] += 0 if ".layers." in name else param.numel()
    linears = tuple(
        (name.rsplit(".", 1)[-1], m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in name
    )
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return ModelShape(
        model_type=str(text.model_type),
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
        vocab=int(text.vocab_size),
        vocab_params=counts["vocab"],
        split_params=counts["split"],
        whole_params=counts["whole"],
        lora_linears=linears,
        outer_whole_params=counts["outer"],
    )
