"""The plan's LM head takes the runtime's test of a plain head (``coati_kto.families.plain_head`` of the model's own
config), not its text model's type: numbers on tiny Gemma 3 (text) and LLaVA (a Llama text model) configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import PLAN_CONFIG

from coati_kto.config.load import load_config
from coati_kto.families import plain_head
from coati_kto.parallel.activations import Workload
from coati_kto.parallel.memory_plan import Layout, plan_memory
from coati_kto.parallel.model_shape import model_shape

TEXT = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 128, "vocab_size": 512,
}  # fmt: skip
VISION = {
    "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "image_size": 32, "patch_size": 16,
}  # fmt: skip
CONFIGS = {
    "gemma3_text": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **TEXT},
    "gemma3_capped": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "final_logit_softcapping": 30.0,
        **TEXT,
    },
    "llava": {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 500,
        "text_config": {"model_type": "llama", **TEXT},
        "vision_config": VISION,
    },
}
TOKENS, VOCAB, HIDDEN = 4 * 64, 512, 64  # PLAN_CONFIG: micro-batch 4 x max_length 64; the configs' vocabulary
# The CPU's head (activations.py): chunked, the hidden states (bf16), the fp32 logits kept (positions x vocabulary
# under 2**24) and two fp32 blocks; the logits path, the bf16 logits and their gradient and two fp32 chunks.
CHUNKED = TOKENS * HIDDEN * 2 + 4 * TOKENS * VOCAB + 2 * 4 * TOKENS * VOCAB  # 1,605,632
LOGITS = 2 * TOKENS * VOCAB * 2 + 2 * 4 * TOKENS * VOCAB  # 1,572,864


@pytest.mark.parametrize(
    ("name", "text_type", "plain", "head"),
    [
        ("gemma3_text", "gemma3_text", True, CHUNKED),  # no soft-capping (the default): the chunked head runs
        ("gemma3_capped", "gemma3_text", False, LOGITS),
        ("llava", "llama", False, LOGITS),  # a Llama text model, but LLaVA's logits path runs
    ],
)
def test_the_plan_counts_the_head_the_runtime_runs(
    tmp_path: Path, name: str, text_type: str, plain: bool, head: int
) -> None:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    (tmp_path / "cfg.yaml").write_text(PLAN_CONFIG.format(model=folder))
    from transformers import AutoConfig

    assert plain_head(AutoConfig.from_pretrained(folder)) is plain  # what LMHead.find asks at run time
    shape = model_shape(str(folder))
    assert (shape.model_type, shape.vocab, shape.hidden) == (text_type, VOCAB, HIDDEN)
    work = Workload.from_config(load_config(tmp_path / "cfg.yaml"), "cpu")
    assert work.plain_head is plain
    assert plan_memory(shape, Layout("hybrid_parallel", "bf16", 0), work).head == head
    assert (CHUNKED, LOGITS) == (1_605_632, 1_572_864)
    from coati_kto.parallel.model_shape import head_is_plain

    assert head_is_plain(str(folder)) is plain
