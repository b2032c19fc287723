"""Image records' prompts -> the text the model sees: each image placeholder expanded through the processor.

A chat template renders each ``{"type": "image"}`` part as the family's placeholder (Gemma 3:
``<start_of_image>``). The processor replaces the i-th placeholder with the i-th image's token run (Gemma 3:
``"\\n\\n<start_of_image>" + <image_soft_token> x image_seq_length + "<end_of_image>\\n\\n"``). The expansion is
done on the rendered prompt alone (``processor(text=[prompt], images=..., return_text_replacement_offsets=True)``,
transformers' public API), so the prompt/completion boundary moves by exactly what the expansion added before it.
:meth:`coati_kto.data.tokenize.Encoder.split` then tokenizes prompt + completion once, as for text: the stored ids
equal ``processor(text=[prompt + completion], images=...)["input_ids"]``, and the completion is the same tokens
with or without the image.

The image token count depends only on the processor's config for Gemma 3; for Gemma 4 (its soft tokens per image)
and Qwen 3.5 (its grid) it depends on the pixels, so the ids are tied to the bytes prepare saw (the prompt hash
holds their digests, and the collator checks the counts again).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from coati_kto.data.formats import Record, RecordError
from coati_kto.data.image_refs import digest


def open_image(image: bytes) -> Image.Image:
    """The decoded image of ``image``'s bytes as the model is to see it (loaded whole, the file closed): upright
    by its EXIF orientation, as transformers' ``load_image``, datasets' Image and any viewer show it (a phone
    photo trained on its raw, rotated pixels), and RGB with any transparency composited onto white, as
    transformers' ``convert_to_rgb`` does. The collator calls the bare image processor, which a Hub config's
    ``"do_convert_rgb": null`` (Gemma 3's) leaves unconverted: a grayscale, palette or RGBA image prepared
    through the processor and then failed the training step's collate."""
    with Image.open(io.BytesIO(image)) as opened:
        opened.load()
        upright = ImageOps.exif_transpose(opened)
    if "A" in upright.getbands() or upright.info.get("transparency") is not None:
        rgba = upright.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return upright.convert("RGB")


def soft_token_id(processor: Any) -> int:
    """The model's image token: the tokenizer's soft token, repeated per image. Gemma 3's processor names its
    placeholder (<start_of_image>) its image token, so the processor's own id is the fallback only."""
    soft = getattr(processor.tokenizer, "image_token_id", None)
    return int(soft if soft is not None else processor.image_token_id)


class ImageExpander:
    """Expands the image placeholders of rendered prompts through ``processor`` (picklable, as the Encoder)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.placeholder: str = processor.image_token
        tokenizer = processor.tokenizer
        self.image_token_id = soft_token_id(processor)
        # The tokens of an image's run a prompt cut must not reach: the soft token and the family's markers
        # (Gemma's boi/eoi, Qwen's vision start/end).
        names = ("boi_token_id", "eoi_token_id", "vision_start_token_id", "vision_end_token_id")
        marks = (getattr(tokenizer, name, None) for name in names)
        self.run_ids = frozenset([self.image_token_id, *(int(m) for m in marks if m is not None)])
        # Gemma 3's soft token differs from its placeholder: typed in a record, it would become an image token the
        # images do not fill (in a completion, under the loss mask).
        self.soft_token: str = tokenizer.convert_ids_to_tokens(self.image_token_id)
        # Per distinct image (its digest): its token run or the processor's refusal (:meth:`_run`).
        self._runs: dict[bytes, tuple[str | None, str]] = {}
        self._texts: dict[str, str] = {}

    def expand(self, prompt: str, completion: str, images: list[bytes], source: str) -> str | RecordError:
        """``prompt`` with its placeholders replaced by the images' token runs; a RecordError when the template
        rendered another number of placeholders than the record has images, or one in the completion, or when
        the processor refuses the images (``bad_image``, its message)."""
        rendered = prompt.count(self.placeholder)
        if rendered != len(images) or self.placeholder in completion:
            where = (
                "the completion holds one" if self.placeholder in completion else f"{rendered} in the prompt"
            )
            return RecordError(
                source,
                "images",
                f"{len(images)} image(s), but the chat template rendered {self.placeholder!r} placeholders: "
                f"{where}; use a template that renders each image part as {self.placeholder!r}",
                "image_placeholders",
            )
        if self.soft_token != self.placeholder and (
            self.soft_token in prompt or self.soft_token in completion
        ):
            part = "completion" if self.soft_token in completion else "prompt"
            return RecordError(
                source,
                "images",
                f"the {part} holds the image token {self.soft_token!r} as text; only the processor places it (one "
                f"run per image, from the {self.placeholder!r} placeholder): remove it",
                "image_placeholders",
            )
        if not images:
            return prompt
        runs = [self._run(image) for image in images]
        refused = next((why for run, why in runs if run is None), None)
        if refused is not None:
            return RecordError(
                source, "images", f"the processor refused the image(s): {refused}", "bad_image"
            )
        # The processor's own placement (its placeholder pattern, the i-th run at the i-th placeholder): the text
        # of a call with all the images at once, as each image's run depends on that image alone.
        return self.processor.get_text_with_replacements([prompt], [run for run, _ in runs])[0][0]

    def _run(self, image: bytes) -> tuple[str | None, str]:
        """(the processor's token run for ``image``, "") or (None, the first line of its refusal, e.g. Qwen's
        aspect ratio over 200): decoded and processed once per distinct image (by :func:`digest`), as records
        share images (several completions rated per image). Kept: the run's text, one shared copy per distinct
        run (Gemma 3's is always the same, Qwen's a repeat of one token), never the pixels."""
        key = digest(image)
        found = self._runs.get(key)
        if found is None:
            try:
                out = self.processor(
                    text=[self.placeholder], images=[open_image(image)], return_text_replacement_offsets=True
                )
                run = out["text_replacement_offsets"][0][0]["replacement"]
                found = (self._texts.setdefault(run, run), "")
            except (ValueError, TypeError, OSError) as err:
                found = (
                    None,
                    str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__,
                )
            self._runs[key] = found
        return found

    def expand_rows(
        self, texts: list[tuple[str, str] | RecordError], images: list[list[bytes]], sources: list[str]
    ) -> list[tuple[str, str] | RecordError]:
        """:meth:`expand` per rendered row (errors kept in place, new ones put there)."""
        out: list[tuple[str, str] | RecordError] = []
        for row, found, source in zip(texts, images, sources, strict=True):
            if isinstance(row, RecordError):
                out.append(row)
                continue
            expanded = self.expand(row[0], row[1], list(found or []), source)
            out.append(expanded if isinstance(expanded, RecordError) else (expanded, row[1]))
        return out

    def image_tokens(self, prompt_ids: list[list[int]]) -> list[int]:
        """The image (soft) tokens per row."""
        return [sum(1 for t in ids if t == self.image_token_id) for ids in prompt_ids]

    def image_starts(self, prompt_ids: list[list[int]]) -> list[int]:
        """Per row, the position of the first token of its first image's run (the row's length without one)."""
        return [next((k for k, t in enumerate(ids) if t in self.run_ids), len(ids)) for ids in prompt_ids]


def image_stats(images: np.ndarray, image_tokens: np.ndarray, tokens: np.ndarray) -> dict[str, Any]:
    """stats.json's image entry: records by their number of images, and the image-token share (image tokens /
    all tokens, over the split)."""
    counts, rows = np.unique(np.asarray(images, np.int64), return_counts=True)
    total = int(np.asarray(tokens, np.int64).sum())
    return {
        "images_per_record": {str(int(c)): int(n) for c, n in zip(counts, rows, strict=True)},
        "image_tokens": int(np.asarray(image_tokens, np.int64).sum()),
        "image_token_share": float(np.asarray(image_tokens, np.int64).sum() / total) if total else 0.0,
    }


def image_cut(
    p_len: np.ndarray,
    image_start: np.ndarray,
    head: np.ndarray,
    max_prompt_length: int,
    max_length: int,
    longest_completion: int,
) -> np.ndarray:
    """[n] bool: rows whose prompt may be cut in a pass and would then lose a token of an image's run. A prompt
    is cut (its BOS ``head`` kept, then its last ``max_prompt_length - head`` tokens) when it is longer than
    ``max_prompt_length`` and its row longer than ``max_length``: in its example, or in a KL row (its prompt with
    another completion of the split, at most ``longest_completion`` tokens). Such a row is dropped: a cut image
    misaligns the ids and the pixels. A row that fits with the split's longest completion is never cut."""
    removed_end = p_len - (max_prompt_length - head)
    may_cut = (p_len > max_prompt_length) & (p_len + longest_completion > max_length)
    return may_cut & (image_start < removed_end)


def typed_image_tokens(
    records: list[Record], processor: Any, on_bad_record: str
) -> tuple[list[Record], list[RecordError]]:
    """(the records, those whose text holds the model's image placeholder or soft token as text): a text-only
    build for a vision-language model runs no processor, so :meth:`ImageExpander.expand`'s check did not run and
    a typed ``<image_soft_token>`` trained as an image token no image fills. Raises the first with
    ``data.on_bad_record: error``."""
    expander = ImageExpander(processor)
    typed = {expander.placeholder, expander.soft_token}
    kept, bad = [], []
    for record in records:
        texts = [record.prompt, record.completion]
        texts = [m.get("content") for t in texts for m in t] if record.chat else texts
        texts = [part.get("text") for t in texts for part in (t if isinstance(t, list) else [{"text": t}])]
        found = next(
            (token for token in typed for text in texts if isinstance(text, str) and token in text), None
        )
        if found is None:
            kept.append(record)
            continue
        bad.append(
            RecordError(
                record.source,
                "messages" if record.chat else "prompt",
                f"the record holds the image token {found!r} as text; only the processor places it (one run per "
                "image, for a record with images): remove it",
                "image_placeholders",
            )
        )
    if bad and on_bad_record == "error":
        raise bad[0]
    return kept, bad
