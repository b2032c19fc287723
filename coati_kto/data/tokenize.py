"""Prompt/completion text -> token ids with a completion-only loss mask, and counted truncation.

Rendering (:mod:`coati_kto.data.chat`): message records go through the tokenizer's own chat template; plain
strings are used as given (a tokenizer that prepends BOS gets its BOS, once: a prompt whose text already starts
with it gets no second one).

Splitting: the whole text (prompt + completion) is tokenized ONCE, so the stored ids are exactly
``tokenizer(whole text)``: what the model sees when the conversation is tokenized whole, and what it produces
at generation time. Tokenizing the completion on its own would be wrong for SentencePiece-style tokenizers
(Metaspace, legacy prepend: Llama-2, Mistral v0.x, Gemma), which put "▁" before any text tokenized alone, so
every completion would start with a token that is not in the conversation. The prompt/completion boundary is
found by character offsets: prompt tokens are those ending at or before the boundary, completion tokens the
rest. A token that straddles the boundary (BPE merging ``"Answer: " + "5"`` into ``"Answer:" + " 5"``) belongs
to the COMPLETION: it is in the loss, the prompt keeps only whole tokens. Unless all it holds of the completion
is whitespace: then it stays with the PROMPT, so a completion starting with a space or newline never puts the
prompt's last token in the loss (Phi-3's ``<|assistant|>`` swallows the whitespace after it; Qwen's and Llama
3's pre-tokenizers merge ``"\n" + "\n"``) and its KL pairs keep that token. Either way such examples are counted
(``boundary_inside_token`` in stats.json) and reported by prepare.

No prompt tokens at all (an empty prompt, or one merged whole into the first completion token, with a
tokenizer that adds no BOS) is a bad record (``no_prompt_tokens``): nothing would predict the first completion
token.

Where a completion ends (:mod:`coati_kto.data.endings`): a chat completion as the template renders the turn,
its end-of-turn token included and no EOS after it; a plain-text completion with EOS appended.

Padding (:func:`coati_kto.data.vocabulary.pad_id`): the pad token, else EOS, else 0; masks come from lengths, so the id never matters.

Truncation (:func:`truncation`): only an example longer than ``max_length`` is cut. Its prompt keeps its END
(at most ``max_prompt_length`` tokens) behind its leading BOS, which a cut never removes (Llama, Gemma and
Mistral models read a sequence without BOS as out of distribution); its completion keeps its START (what fits
in the rest). Every cut is counted by the caller; an example with no room left for a completion token is
dropped (or an error), never cropped to nothing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from coati_kto.config.hub import hub_problems, looks_like_path, missing_path
from coati_kto.data.chat import render_chats
from coati_kto.data.endings import Endings
from coati_kto.data.formats import RecordError
from coati_kto.data.images import ImageExpander
from coati_kto.data.template_clock import build_day, rendered_as_of
from coati_kto.errors import ConfigError

if TYPE_CHECKING:
    from coati_kto.config.schema import ModelSection


# The files a tokenizer's vocabulary loads from (tokenizer_config.json and the special tokens map hold none):
# fast tokenizers' tokenizer.json, SentencePiece models, slow BPE (vocab.json + merges.txt), WordPiece, Mistral's.
VOCABULARY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)


def load_tokenizer(model: ModelSection) -> PreTrainedTokenizerBase:
    """``model.tokenizer`` (default ``model.path``); ConfigError naming both keys when it cannot be loaded."""
    name = model.tokenizer or model.path
    if not Path(name).expanduser().exists():  # one line now, not a minute of hub retries and a repo-id error
        key = "model.tokenizer" if model.tokenizer else "model.path"
        if looks_like_path(name):
            raise ConfigError(missing_path(key, name))
        if key == "model.path" and (problems := hub_problems(key, name)):  # a model repo holds config.json
            raise ConfigError(problems[0])
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, ImportError) as err:  # ImportError: a backend package it needs is missing
        text = str(err).strip()
        first = text.splitlines()[0].strip() if text else type(err).__name__
        if first.endswith(":"):  # "...from one of:" opens a list on the next lines: one line with the list
            first = " ".join(text.split())
        folder = Path(name).expanduser()
        if folder.is_dir() and not any((folder / f).is_file() for f in VOCABULARY_FILES):
            key = "model.tokenizer" if model.tokenizer else "model.path"
            held = ", ".join(sorted(p.name for p in folder.iterdir())[:12]) or "nothing"
            raise ConfigError(
                f"{key} {name}: cannot load a tokenizer: the directory holds none of {', '.join(VOCABULARY_FILES)} "
                f"(it holds {held}); copy the tokenizer's files there, or set model.tokenizer to a directory "
                "that has them"
            ) from None
        raise ConfigError(f"model.tokenizer / model.path {name}: cannot load a tokenizer ({first})") from None


def bos_prefix(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids the tokenizer puts before plain text by itself (e.g. Llama's BOS); [] for most chat tokenizers."""
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    special = tokenizer("x", add_special_tokens=True)["input_ids"]
    for k in range(len(special) - len(plain) + 1):
        if special[k : k + len(plain)] == plain:
            return special[:k]
    return []


def prompt_hash(text: str, images: list[bytes] | tuple[bytes, ...] = ()) -> int:
    """A stable 63-bit id of a rendered prompt and the sha256 of each of its images (KL pairs avoid pairing
    examples with equal prompts; the same words with other images are another prompt)."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8)
    for image in images:
        h.update(hashlib.sha256(image).digest())
    return int.from_bytes(h.digest(), "little") >> 1


def no_prompt_tokens(source: str) -> RecordError:
    """The record whose prompt gives no token before the completion (see the module docstring)."""
    return RecordError(
        source,
        "prompt",
        "no prompt tokens (the prompt is empty, or merges whole into the completion's first token, and the "
        "tokenizer adds no BOS): nothing would predict the completion's first token; give the record a prompt",
        "no_prompt_tokens",
    )


class Encoder:
    """Batched encoder for ``datasets.map``; picklable, so it runs in ``num_proc`` worker processes.

    ``stop_ids``: ids that end a chat completion without an added EOS besides the tokenizer's EOS and the
    template's end of turn (the checkpoint's generation ``eos_token_id``: :func:`~coati_kto.data.endings.generation_eos_ids`).
    ``processor``: a vision-language processor (its tokenizer is ``tokenizer``): rows of an ``images`` column
    get their placeholders expanded (:mod:`coati_kto.data.images`). ``eos_fallback``: the checkpoint's EOS, for
    a tokenizer without one (:func:`~coati_kto.data.endings.checkpoint_eos`)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: dict[str, Any] | None = None,
        stop_ids: list[int] | tuple[int, ...] = (),
        processor: Any = None,
        eos_fallback: tuple[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.images = None if processor is None else ImageExpander(processor)
        self.template_kwargs = template_kwargs or {}
        self.bos = bos_prefix(tokenizer)
        self.endings = Endings(tokenizer, self.template_kwargs, stop_ids, eos_fallback)
        self.day = build_day()  # the build's day, which the datasets.map workers render as of too
        self._backend: Tokenizer | None = None
        if getattr(tokenizer, "is_fast", False):
            # The Rust tokenizer itself: offsets and char_to_token without converting every row to Python
            # lists. A copy without truncation/padding, which a tokenizer.json may carry (transformers turns
            # them off per call; we call the backend directly).
            self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            self._backend.no_truncation()
            self._backend.no_padding()

    def split(
        self, prompts: list[str], completions: list[str]
    ) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """(prompt ids, completion ids, boundary inside a token) per row; prompt ids + completion ids ==
        ``tokenizer(prompt + completion, add_special_tokens=False)`` (see the module docstring)."""
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        if self._backend is None:
            return self._split_slow(prompts, texts)
        p_ids, c_ids, inside = [], [], []
        for enc, prompt, text in zip(
            self._backend.encode_batch(texts, add_special_tokens=False), prompts, texts, strict=True
        ):
            ids, b = enc.ids, len(prompt)
            k = len(ids) if b == len(text) else enc.char_to_token(b)
            if (
                k is None
            ):  # the boundary character made no token (a normaliser dropped it): first token after it
                k = next((i for i, (_, end) in enumerate(enc.offsets) if end > b), len(ids))
            straddles = k < len(ids) and enc.offsets[k][0] < b
            if straddles and k + 1 < len(ids) and not text[b : enc.offsets[k][1]].strip():
                k += 1  # only the completion's leading whitespace is in the token: it stays with the prompt
            p_ids.append(ids[:k])
            c_ids.append(ids[k:])
            inside.append(straddles)
        return p_ids, c_ids, inside

    def _split_slow(self, prompts: list[str], texts: list[str]) -> tuple[list, list, list]:
        """Python tokenizers have no offsets: the split of :meth:`split` from decoded text instead
        (:meth:`_slow_boundary`), on ``tokenizer(whole text)`` and ``tokenizer(prompt)``, each tokenized once."""
        whole = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        alone = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        p_ids, c_ids, inside = [], [], []
        for w, a in zip(whole, alone, strict=True):
            k, straddles = self._slow_boundary(self.tokenizer, w, a)
            p_ids.append(w[:k])
            c_ids.append(w[k:])
            inside.append(straddles)
        return p_ids, c_ids, inside

    @staticmethod
    def _slow_boundary(
        tokenizer: PreTrainedTokenizerBase, whole: list[int], alone: list[int]
    ) -> tuple[int, bool]:
        """(k, straddles) for a tokenizer without offsets: ``whole[:k]`` are the prompt's ids, ``whole`` being
        ``tokenizer(prompt + completion)`` and ``alone`` ``tokenizer(prompt)``; the rule of :meth:`split`.

        k is the largest such that ``whole[:k]`` spells a prefix of the prompt: every token ending at or before the
        boundary is the prompt's, though ``alone`` may differ from ``whole`` before it (the GPT-2 / cl100k
        pre-tokenizer's ``\\s+(?!\\S)`` keeps a trailing "\\n\\n" whole but splits it when text follows). Then a token
        straddling the boundary (``straddles``) goes to the completion, unless all it holds of the completion is
        whitespace and a completion token follows it. Spelling is compared from the last token the two share (the
        ids before it are the prompt's either way), against ``alone`` decoded, not the prompt text, so a lossy
        decode (unknown tokens, normalisers) earlier in the prompt cannot move the boundary. Decoded length grows
        with k, so k is found by galloping from there and bisecting: O(m log m) decoded tokens, m the prompt's
        tokens from that shared one on (a few), never the whole row decoded at every k."""
        if not alone:
            return 0, False
        shared = next((j for j, (x, y) in enumerate(zip(whole, alone, strict=False)) if x != y), len(alone))
        c = max(shared - 1, 0)  # a token both share: the decoder starts both spellings in the same state

        def spell(k: int) -> str:
            return tokenizer.decode(whole[c:k], clean_up_tokenization_spaces=False)

        tail = tokenizer.decode(alone[c:], clean_up_tokenization_spaces=False)
        lo, step = c, 1  # spell(lo) is no longer than tail; find the last such k
        while lo + step <= len(whole) and len(spell(lo + step)) <= len(tail):
            lo, step = lo + step, step * 2
        hi = min(lo + step, len(whole) + 1)  # past the end, or spells longer than tail
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(spell(mid)) <= len(tail) else (lo, mid)
        k = lo
        while k > c and not tail.startswith(spell(k)):  # a partial character ("\ufffd") or a lossy spelling
            k -= 1
        straddles = k < len(whole) and spell(k) != tail
        if straddles and k + 1 < len(whole):
            held = spell(k + 1)
            if held.startswith(tail) and not held[len(tail) :].strip():
                k += 1  # only the completion's leading whitespace is in the token: it stays with the prompt
        return k, straddles

    def _render(self, batch: dict[str, list]) -> list[tuple[str, str] | RecordError]:
        """(prompt text, completion text) per row; chat rows through the template, errors in place."""
        texts: list[tuple[str, str] | RecordError] = list(
            zip(batch["prompt"], batch["completion"], strict=True)
        )
        chat_rows = [i for i in range(len(texts)) if batch["chat"][i]]
        if chat_rows:
            tools = batch.get("tools") or [""] * len(texts)
            rendered = render_chats(
                self.tokenizer,
                [json.loads(batch["prompt"][i]) for i in chat_rows],
                [json.loads(batch["completion"][i]) for i in chat_rows],
                [batch["source"][i] for i in chat_rows],
                [json.loads(tools[i]) if tools[i] else None for i in chat_rows],
                self.template_kwargs,
            )
            for i, r in zip(chat_rows, rendered, strict=True):
                texts[i] = r
        return texts

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        """Columns prompt/completion (JSON message lists when ``chat``)/chat/source/tools (JSON, "" for none) -> prompt_ids,
        completion_ids, prompt_hash, boundary_inside_token, completion_end (:meth:`Endings.end`),
        stop_inside_completion (:meth:`Endings.stops_early`), error_reason, error (""
        when the record is fine); with a processor, column images (bytes per row) in, and images, image_tokens
        (counts per row) and image_start (the first token of the first image's run) out."""
        with rendered_as_of(self.day):
            texts = self._render(batch)
        images = batch["images"] if self.images is not None else [[]] * len(texts)
        if self.images is not None:
            texts = self.images.expand_rows(texts, images, batch["source"])
        bad = {i: t for i, t in enumerate(texts) if isinstance(t, RecordError)}
        prompts = ["" if i in bad else t[0] for i, t in enumerate(texts)]
        completions = ["" if i in bad else t[1] for i, t in enumerate(texts)]
        p_ids, c_ids, inside = self.split(prompts, completions)
        out: dict[str, list] = {
            "prompt_ids": [],
            "completion_ids": [],
            "boundary_inside_token": inside,
            "completion_end": [],
            "stop_inside_completion": [self.endings.stops_early(c) for c in c_ids],
        }
        for i, (p, c, chat) in enumerate(zip(p_ids, c_ids, batch["chat"], strict=True)):
            if not chat and p[: len(self.bos)] != self.bos:  # text already rendered with its BOS: no second
                p = self.bos + p
            c, how = self.endings.end(c, chat)
            if not p and i not in bad:
                bad[i] = no_prompt_tokens(batch["source"][i])
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["completion_end"].append(how)
        out["prompt_hash"] = [prompt_hash(p, i) for p, i in zip(prompts, images, strict=True)]
        if self.images is not None:
            out["images"] = [len(i) for i in images]
            out["image_tokens"] = self.images.image_tokens(out["prompt_ids"])
            out["image_start"] = self.images.image_starts(out["prompt_ids"])
        out["error_reason"] = [bad[i].reason if i in bad else "" for i in range(len(texts))]
        out["error"] = [str(bad[i]) if i in bad else "" for i in range(len(texts))]
        return out


def encode(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Any,
    completion: Any,
    chat: bool,
    source: str = "<record>",
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    stop_ids: list[int] | tuple[int, ...] = (),
) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one record, exactly as prepare encodes it; raises RecordError."""
    row = {
        "prompt": [json.dumps(prompt) if chat else prompt],
        "completion": [json.dumps(completion) if chat else completion],
        "chat": [chat],
        "source": [source],
        "tools": [json.dumps(tools) if tools else ""],
    }
    out = Encoder(tokenizer, template_kwargs, stop_ids)(row)
    if out["error"][0]:
        raise RecordError.restore(out["error"][0], out["error_reason"][0], source)
    return out["prompt_ids"][0], out["completion_ids"][0]


def truncation(
    prompt_len: np.ndarray | int, completion_len: np.ndarray | int, max_length: int, max_prompt_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens to keep: (prompt tokens kept from the END, completion tokens kept from the START), elementwise.

    Examples within ``max_length`` are kept whole. A longer one keeps at most ``max_prompt_length`` prompt
    tokens and fills the rest of ``max_length`` with completion. A kept completion length of 0 means the
    example cannot fit (only possible when ``max_prompt_length >= max_length``, which the config forbids).
    """
    p = np.asarray(prompt_len, dtype=np.int64)
    c = np.asarray(completion_len, dtype=np.int64)
    over = p + c > max_length
    keep_p = np.where(over, np.minimum(p, max_prompt_length), p)
    keep_c = np.where(over, np.clip(max_length - keep_p, 0, None), c)
    return keep_p, np.minimum(keep_c, c)
