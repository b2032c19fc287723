"""Model-family facts: the one place that knows how a family's model behaves under our passes and plugins.

What lives here: which model class a checkpoint builds (from config.json alone), which classes shardformer can
shard, the check that refuses a family a plugin cannot run (called by the config schema at load), which heads
are exactly ``lm_head(hidden)`` (the chunked head is exact for them), the attention window a packed mask must
apply, and, in ``policies``, the shardformer policies the project corrects. A new family's facts go here and in
``coati_kto.testing.tiny`` (its tiny builder), nowhere else.

May import: ``coati_kto.errors`` only (a leaf: the config schema imports it). ColossalAI is never imported at
module level here (3-4 s): the coverage scan reads its source instead, and ``policies`` imports it lazily.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from coati_kto.errors import ConfigError

# Families whose causal-LM forward is exactly ``logits = lm_head(final_hidden)`` (no soft-capping or scaling
# after the head): the chunked head is exact for them. Others keep the logits path.
HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"})


@functools.cache
def shardformer_model_classes() -> frozenset[str]:
    """Full class names (``transformers.models.llama.modeling_llama.LlamaForCausalLM``) with a shardformer policy.

    Read from ColossalAI's own ``auto_policy.py`` without importing ColossalAI (3-4 s): config checks stay fast.
    """
    spec = importlib.util.find_spec("colossalai")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(spec.submodule_search_locations[0]) / "shardformer" / "policies" / "auto_policy.py"
    for node in ast.walk(ast.parse(source.read_text())):
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        if any(getattr(t, "id", None) == "_POLICY_LIST" for t in targets) and isinstance(
            node.value, ast.Dict
        ):
            return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset()


def model_class_name(model_dir: str) -> str | None:
    """The full class name AutoModelForCausalLM builds for ``model_dir``, from its config.json alone.

    None when it cannot be known without loading (a hub id, or remote code): the plugin then checks at build.
    """
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    raw = json.loads(config_file.read_text())
    architectures, model_type = raw.get("architectures") or [], raw.get("model_type")
    if "auto_map" in raw or not architectures or not model_type:
        return None
    module = model_type.replace("-", "_")
    return f"transformers.models.{module}.modeling_{module}.{architectures[0]}"


def check_model_family(plugin: str, model_dir: str, key: str) -> None:
    """ConfigError when ``plugin`` is hybrid_parallel and the model class at ``model_dir`` has no shardformer
    policy. Checked from config.json alone; unknown classes (hub ids, remote code) are left to the plugin."""
    if plugin != "hybrid_parallel":
        return
    name = model_class_name(model_dir)
    supported = shardformer_model_classes()
    if name is None or not supported or name in supported:
        return
    families = sorted({c.rsplit(".", 1)[1] for c in supported if c.endswith("ForCausalLM")})
    raise ConfigError(
        f"{key} {model_dir}: {name.rsplit('.', 1)[1]} has no ColossalAI shardformer policy, so plugin.name "
        f"hybrid_parallel cannot shard it: use plugin.name low_level_zero or ddp (causal LMs with a policy: "
        f"{', '.join(families)})"
    )


def attention_window(config: Any) -> int | None:
    """The sliding window that Hugging Face's eager/sdpa causal mask applies for ``config`` (None: full causal).

    A 4D mask replaces that mask, so the packed mask must apply the window itself: transformers 4.51 masks key
    k for query q when q - k >= config.sliding_window (Mistral, Mixtral, Qwen2/3 build it from the config
    value alone, whatever ``use_sliding_window`` says; Qwen2-MoE sets it to None when unused).
    """
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def eager_attention_reason(model_dir: str) -> str | None:
    """Why ``model_dir``'s attention must run eager (None when any kernel computes it): attention-logit
    soft-capping (Gemma 2; Gemma 3 when set) is applied by transformers' eager kernel only, and sdpa / flash
    attention skip it without an error. Read from config.json alone; None when there is none."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return None
    raw = json.loads(config_file.read_text())
    softcap = raw.get("attn_logit_softcapping", (raw.get("text_config") or {}).get("attn_logit_softcapping"))
    if softcap is None:
        return None
    return f"its attention soft-capping (attn_logit_softcapping {softcap}) runs in the eager kernel only"
