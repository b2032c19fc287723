"""A tiny random chat model built offline: ``coati-kto tiny-model DIR`` (a model to try the commands on, on a CPU).

``chatml_tokenizer`` trains a byte-level BPE (any text tokenizes: the 256 bytes are its alphabet) with the ChatML
chat template; ``build_llama`` is a randomly initialised Llama sized for a CPU; ``write_tiny_model`` saves both,
Hugging Face format, where ``model.path`` can point. The test suite's tiny models (``coati_kto.testing.tiny``)
are built with the same two functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from coati_kto.errors import UserError

# ChatML (Qwen's template); add_generation_prompt opens the assistant turn.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# What the BPE merges are learnt from: chat-like English, digits, weekdays and months (the README example's data).
TINY_CORPUS = [
    "What comes after Monday? Tuesday. What comes before Monday? Sunday.",
    "Monday Tuesday Wednesday Thursday Friday Saturday Sunday",
    "January February March April May June July August September October November December",
    "zero one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9 10",
    "Hello! How can I help you today? Thank you for asking. The answer is yes.",
    "Please answer the question. I cannot help with that. Sorry, that is not possible.",
] * 20

MODEL_CARD = """# A tiny random chat model

Written by `coati-kto tiny-model` (seed {seed}): a randomly initialised Llama (hidden size {hidden}, {layers}
layers, {params} parameters) with a byte-level BPE tokenizer and the ChatML chat template. It knows nothing: it
exists to try coati-kto's commands on a CPU in seconds. `coati-kto tiny-model` rewrites this folder when asked.
"""


def bpe_tokenizer(
    corpus: Iterable[str], vocab_size: int, special: list[str], bos: str, eos: str, pad: str, template: str
) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` trained on ``corpus``, with these special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=None,
        chat_template=template,
        padding_side="right",
    )


def chatml_tokenizer(corpus: Iterable[str] = TINY_CORPUS, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """ChatML: ``<|im_end|>`` ends a turn and is the EOS, ``<|endoftext|>`` pads."""
    return bpe_tokenizer(
        corpus, vocab_size, SPECIAL_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE
    )


def build_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 1024,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized for a CPU; heads divide by 2 so tp_size=2 works."""
    config = LlamaConfig(
        # A multiple of 128, so shardformer's padding (to 64 x tp_size) is a no-op here; padded vocabularies
        # are covered by coati_kto.testing.tiny.save_tiny_family's models (tests/distributed/test_families.py).
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
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def write_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    write: Callable[[Path, Callable[[Path], None]], None] | None = None,
) -> str:
    """Save a ChatML tokenizer and a random Llama into ``out_dir``; returns the line that says what was written.

    Refuses (UserError) a folder that holds other files than a previous ``tiny-model`` run's (its README.md
    says so), so a model of the user's is never overwritten; the same arguments write the same weights.
    ``write(out, fill)``: how the folder is written (the CLI's ``durable.write_dir``: whole or as it was, under
    a stop too); by default ``fill(out)`` in place.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"coati-kto tiny-model: {out} is a file, not a folder")
    card = out / "README.md"
    if out.is_dir() and any(out.iterdir()) and not _written_here(card):
        raise UserError(
            f"coati-kto tiny-model: {out} is not empty and was not written by coati-kto tiny-model: "
            "name a new folder (nothing was written)"
        )
    if hidden_size < 4 or hidden_size % 4 or num_layers < 1:
        raise UserError(
            f"coati-kto tiny-model: --hidden-size must be a positive multiple of 4 (got {hidden_size}) and "
            f"--layers >= 1 (got {num_layers})"
        )
    tokenizer = chatml_tokenizer()
    model = build_llama(tokenizer, hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    params = sum(p.numel() for p in model.parameters())
    from transformers.utils import logging as hf_logging

    def fill(folder: Path) -> None:
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" for a file of a few hundred KB: noise on stderr
        try:
            model.save_pretrained(folder)
        finally:
            if shown:
                hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(folder)
        text = MODEL_CARD.format(seed=seed, hidden=hidden_size, layers=num_layers, params=f"{params:,}")
        (folder / card.name).write_text(text)

    if write is None:
        out.mkdir(parents=True, exist_ok=True)
        fill(out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        write(out, fill)
    return (
        f"wrote {out}: a random Llama ({params / 1e6:.2f}M parameters, hidden size {hidden_size}, {num_layers} "
        f"layers) and a {len(tokenizer)}-token ChatML tokenizer; use it as model.path={out}"
    )


def _written_here(card: Path) -> bool:
    """Whether ``card`` is the README.md a previous ``coati-kto tiny-model`` wrote."""
    return card.is_file() and card.read_text().startswith(MODEL_CARD.split("\n", 1)[0])
