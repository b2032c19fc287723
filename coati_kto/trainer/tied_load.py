"""A tied weight that a checkpoint stores once, loaded into a pipeline stage that holds it under its other name.

A checkpoint saved without pipeline stages stores a tied LM head once, under the embedding's name
(``save_tied_weights_once``): its index has ``model.embed_tokens.weight`` and no ``lm_head.weight``. Under
``plugin.pp_size`` > 1 the last stage holds the head as ``lm_head.weight`` alone, so ColossalAI's sharded load
finds no entry for it (it loads with ``strict=False`` and logs the key at INFO) and the head would keep the base
model's weights. ``load_tied_aliases`` fills such a head from the source's shard after the model load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coati_kto.models.lora import base_module


def tied_aliases(module: Any) -> dict[str, str]:
    """``module``'s tied names (alias -> source, as ``lm_head.weight -> model.embed_tokens.weight``) when its
    config ties the word embeddings; {} otherwise."""
    tied = getattr(module, "_tied_weights_keys", None) or {}
    config = getattr(module, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if not isinstance(tied, dict) or not getattr(text, "tie_word_embeddings", False):
        return {}
    return dict(tied)


def unsaved_aliases(names: list[str], aliases: dict[str, str], weight_map: dict[str, str]) -> dict[str, str]:
    """Of the parameter ``names`` this rank holds, the tied aliases the index ``weight_map`` lacks while it has
    their source, which this rank does not hold (a later pipeline stage's head): held name -> the source's name
    in the index. ``names`` may carry a prefix (a PeftModel's): the source takes the same one."""
    held, out = set(names), {}
    for name in names:
        for alias, source in aliases.items():
            if name != alias and not name.endswith("." + alias):
                continue
            prefixed = name[: len(name) - len(alias)] + source
            if name not in weight_map and prefixed in weight_map and prefixed not in held:
                out[name] = prefixed
    return out


def load_tied_aliases(model: Any, model_dir: Path) -> list[str]:
    """Every rank calls, after ``booster.load_model(model, model_dir)`` and before the optimizer state loads.

    Loads each tied alias this rank holds but the checkpoint in ``model_dir`` stores under its source only (see
    the module docstring) from the source's shard, through ColossalAI's own loader (which shards it under tensor
    parallelism), then refreshes the mixed-precision masters from the weights (``update_master_params``, as the
    sharded load does). Returns the names loaded ([] where there was nothing to do)."""
    indexes = sorted(Path(model_dir).glob("*.index.json"))
    if not indexes:
        return []
    weight_map = json.loads(indexes[0].read_text())["weight_map"]
    module = model.unwrap()
    names = [name for name, _ in module.named_parameters()]
    wanted = unsaved_aliases(names, tied_aliases(base_module(model)), weight_map)
    if not wanted:
        return []
    from colossalai.checkpoint_io.utils import load_shard_state_dict, load_state_dict_into_model

    for name, source in wanted.items():
        shard = Path(model_dir) / weight_map[source]
        tensor = load_shard_state_dict(shard, use_safetensors=shard.suffix == ".safetensors")[source]
        load_state_dict_into_model(
            module, {name: tensor}, missing_keys=[], strict=False, load_sub_module=True
        )
    model.update_master_params()
    return sorted(wanted)
