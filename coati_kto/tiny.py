"""Tiny Llama models and byte-level BPE tokenizers built offline (no hub): for tests and the CPU quickstart."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# ChatML, the template of the seeds' data; add_generation_prompt opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(
    corpus: Iterable[str], vocab_size: int = 512, pad_is_eos: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus`` with a ChatML chat template; eos is ``<|im_end|>``.

    ``pad_is_eos`` reproduces the common (and dangerous) setup where padding and end-of-sequence share an id.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>" if pad_is_eos else "<|endoftext|>",
        unk_token=None,
        chat_template=CHATML_TEMPLATE,
        padding_side="right",
    )


def build_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 1024,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized for CPU tests; heads divide by 2 so tp_size=2 works."""
    config = LlamaConfig(
        # A multiple of 128: shardformer pads the vocabulary to 64 x tp_size, and ColossalAI's optimizer
        # checkpoint asserts an even split, so tp_size 2 needs the padding to be a no-op.
        vocab_size=-(-len(tokenizer) // 128) * 128,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_tiny_model(
    out_dir: str | Path, corpus: Iterable[str], vocab_size: int = 512, **model_kwargs
) -> Path:
    """Build a tokenizer and a Llama and save both, HF-format, into ``out_dir`` (what ``model.path`` points to)."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    model = build_llama(tokenizer, **model_kwargs)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
