"""The run's token ids against its models: the id a batch pads with (a tokenizer's pad token the model cannot
embed is passed over) and whether ``model.reference_path``'s own tokenizer reads those ids as the run's does."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coati_kto.config.hub import same_folder
from coati_kto.data.tokenize import VOCABULARY_FILES, load_tokenizer
from coati_kto.errors import ConfigError
from coati_kto.families import vocabulary_size

if TYPE_CHECKING:
    from coati_kto.config.schema import ModelSection


def pad_id(tokenizer: PreTrainedTokenizerBase, vocab_size: int | None = None) -> tuple[int, str]:
    """(the id to pad batches with, a one-line note for the user or "").

    The pad token when the tokenizer has one; else EOS (GPT-2 and many base models have no pad token); else 0.
    Safe whatever the id the model can embed: attention and loss masks come from row lengths, never from
    ``ids != pad``. But padded positions still go through the embedding, so with ``vocab_size`` (the model's
    embedding rows) an id past them (a pad token added to the tokenizer, the model not resized) is passed over.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    def fits(token: int | None) -> bool:
        return token is not None and (vocab_size is None or int(token) < vocab_size)

    if fits(pad):
        return int(pad), ""
    if pad is not None:  # a pad token the model has no embedding for
        fallback = int(eos) if fits(eos) else 0
        return fallback, (
            f"note: the tokenizer's pad token {tokenizer.pad_token!r} (id {int(pad)}) is past the model's "
            f"{vocab_size} token embeddings; padding with id {fallback} instead, which is harmless: masks come "
            "from lengths"
        )
    if fits(eos):
        eos = int(eos)
        return eos, (
            f"note: the tokenizer has no pad token; padding with EOS {tokenizer.eos_token!r} (id {eos}), "
            "which is harmless: masks come from lengths"
        )
    return (
        0,
        "note: the tokenizer has no pad or EOS token; padding with id 0, which is harmless: masks come from lengths",
    )


def model_pad_id(tokenizer: PreTrainedTokenizerBase, model: ModelSection) -> tuple[int, str]:
    """:func:`pad_id` for the run's models: an id past the policy's or the reference's embedding rows (from
    their config.json) passed over. prepare's stats, its note and the run's batches all pad with this one."""
    return pad_id(tokenizer, vocabulary_size(model.path, model.reference_path))


def reference_tokenizer_problem(model: ModelSection) -> str | None:
    """Why ``model.reference_path``'s own tokenizer reads the run's token ids as other tokens (None when it reads
    them alike, has none, or is the run's): the reference would score other text than the policy, with no error
    when its vocabulary is as large. Compared on the ids both define outside their added tokens (a chat model's
    renamed special tokens are no mismatch). Local folders only (a Hub id's is read from the hub cache at load)."""
    reference = model.reference_path
    folder = Path(reference or "")
    if not reference or same_folder(reference, model.tokenizer or model.path) or not folder.is_dir():
        return None
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        return None
    try:
        ours = load_tokenizer(model)
        theirs = AutoTokenizer.from_pretrained(folder, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, ConfigError):  # the run's own tokenizer's problems are said where it loads
        return None
    mine, other = _base_vocabulary(ours), _base_vocabulary(theirs)
    differ = sorted(i for i in mine.keys() & other.keys() if mine[i] != other[i])
    if not differ:
        return None
    first = differ[0]
    return (
        f"model.reference_path {reference}: its tokenizer reads the run's token ids as other tokens ({len(differ)} "
        f"of the {len(mine.keys() & other.keys())} ids both define; id {first} is {other[first]!r} there and "
        f"{mine[first]!r} here): the reference would score other text; give it a model of the run's tokenizer"
    )


def _base_vocabulary(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """id -> token of ``tokenizer``'s vocabulary, its added tokens left out."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return {int(i): token for token, i in tokenizer.get_vocab().items() if int(i) not in added}
