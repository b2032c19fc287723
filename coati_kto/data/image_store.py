"""What prepare adds for image records (issue 49): the processor, its fingerprint, the image-cut rule, the summary.

Image records are read only where :class:`~coati_kto.data.settings.PrepareSettings` ``images`` is set (``coati-kto
prepare``, ``inspect`` and ``train`` set it) and ``model.path`` is a vision-language model
(:func:`coati_kto.families.vision_language`). Elsewhere (a text-only model, or a caller that leaves ``images``
unset) they stay refused in one line by :mod:`coati_kto.data.formats`.

The prepared rows of an image split hold, besides the text columns, ``images`` (the bytes of the row's prompt's
images, in order: the KL row uses the same prompt, so the same images) and ``image_tokens`` (the image soft
tokens in that prompt). The bytes are stored, not pixel values: they are small, and the collator runs the image
processor per micro-batch.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from coati_kto.config.hub import is_hub_dataset
from coati_kto.data.files import load_records
from coati_kto.data.formats import Record, RecordError
from coati_kto.data.image_refs import digest
from coati_kto.data.images import soft_token_id, typed_image_tokens
from coati_kto.data.processors import load_processor_for_images, pan_and_scan
from coati_kto.data.tables import progress_bars
from coati_kto.errors import ConfigError

# The processors image records train with -> whether their image token count is fixed (image_seq_length).
IMAGE_FAMILIES: dict[str, bool] = {
    "Gemma3Processor": True,
    "Gemma4ImageProcessing": False,
    "Qwen3VLImageProcessing": False,
}

if TYPE_CHECKING:
    from coati_kto.config.schema import ModelSection
    from coati_kto.data.settings import PrepareSettings


def vision_language_model(settings: PrepareSettings) -> bool:
    """Whether ``model.path`` is a vision-language model (its config read, no weights); False where it has no
    config prepare can read (prepare needs only the tokenizer: the model's own checks come at training)."""
    from transformers import AutoConfig

    from coati_kto.families import vision_language

    model = settings.model
    try:
        config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    except (OSError, ValueError, KeyError):
        return False
    return vision_language(config)


class UnloadableProcessor:
    """A vision-language ``model.path`` whose processor cannot be loaded (a checkpoint saved without its processor
    files): text records prepare as before; the first use for an image (its config hashed for the fingerprint)
    raises the load's one line."""

    def __init__(self, error: ConfigError) -> None:
        self.error = error

    def to_json_string(self) -> str:
        raise self.error


def load_processor(settings: PrepareSettings) -> Any | None:
    """``model.path``'s processor where image records are read (``settings.images`` and a vision-language
    model), else None; an :class:`UnloadableProcessor` (its ConfigError raised once an image needs it) when it
    cannot be loaded."""
    if not settings.images or not vision_language_model(settings):
        return None
    try:
        return model_processor(settings.model)
    except ConfigError as err:
        return UnloadableProcessor(err)


def model_processor(model: ModelSection) -> Any:
    """``model.path``'s processor (it must take images; Gemma 4's and Qwen 3.5's without their video processor,
    :mod:`coati_kto.data.processors`); ConfigError (one line) when it cannot be loaded or asks for Gemma 3's
    pan-and-scan crops."""
    try:
        processor = load_processor_for_images(model.path, model.trust_remote_code)
    except (OSError, ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model.path {model.path}: cannot load its processor for images ({first})"
        ) from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(
            f"model.path {model.path}: its processor ({type(processor).__name__}) takes no images"
        )
    if pan_and_scan(processor):  # prepare expanded one run per image, the collator's crops added more pixels
        raise ConfigError(
            f"model.path {model.path}: its image processor's config sets do_pan_and_scan true: image records take "
            "one image per image part, no pan-and-scan crops; set do_pan_and_scan to false"
        )
    return processor


def collator_images(model: ModelSection) -> dict[str, Any]:
    """The ``KTOCollator`` keywords of image rows, from ``model.path``'s processor (loaded once): its image
    processor, the image soft token's id (the tokenizer's, as prepare counted it) and its fixed tokens per image
    (Gemma 3's ``image_seq_length``; None for Gemma 4 and Qwen 3.5, whose counts the image processor gives per
    image). Any other family is refused in one line: its processor is not proven here."""
    processor = model_processor(model)
    name = type(processor).__name__
    if name not in IMAGE_FAMILIES:
        raise ConfigError(
            f"model.path {model.path}: image records train on Gemma 3, Gemma 4 and Qwen 3.5 vision-language "
            f"models only ({name} is not one of their processors)"
        )
    fixed = IMAGE_FAMILIES[name]
    if fixed:  # a processor of another checkpoint: prepare passed, and step 1 raised in the model's forward
        from transformers import AutoConfig

        expected = getattr(AutoConfig.from_pretrained(model.path), "mm_tokens_per_image", None)
        if expected is not None and int(processor.image_seq_length) != int(expected):
            raise ConfigError(
                f"model.path {model.path}: its processor gives {processor.image_seq_length} image tokens per image "
                f"(image_seq_length) and its model takes {expected} (mm_tokens_per_image): the processor files "
                "are another checkpoint's; use the model's own"
            )
    return {
        "image_processor": processor.image_processor,
        "image_token_id": soft_token_id(processor),
        "image_seq_length": int(processor.image_seq_length) if fixed else None,
    }


def processor_hash(processor: Any) -> str:
    """Hash of the processor's config (its image processor's size, ``image_seq_length``...): what decides the
    image token runs, so a changed one re-prepares."""
    return hashlib.sha256((type(processor).__name__ + processor.to_json_string()).encode()).hexdigest()


def images_fingerprint(settings: PrepareSettings, processor: Any, parts: dict[str, Any]) -> dict | None:
    """The fingerprint's ``images`` entry: the processor's hash and a digest of every record's images (an image
    file referenced by path is not one of the data files), or None when no record holds an image (the rows are
    then the text ones). Reads the records; ``parts``: the fingerprint so far (the Hub commits it resolved). A
    record skipped (``data.on_bad_record: skip``: an image missing, unreadable or not decodable) adds nothing: fixed,
    it adds its images, so the data is prepared again with it. The images are read, not decoded: their bytes are
    what the digest needs, and decoding every image cost each launch 5.9 s per 1000 (512 x 512 JPEGs)."""
    d = settings.data
    shas = {e[0]: e[1] for e in parts["train_files"] + parts["eval_files"] if is_hub_dataset(e[0])}
    h, found = hashlib.sha256(), 0
    with progress_bars(False):
        for files, key in ((d.train_files, "data.train_files"), (d.eval_files, "data.eval_files")):
            if not files:
                continue
            for record in load_records(
                files, key, d.on_bad_record, None, shas, images=True, decode_images=False
            ).records:
                h.update(json.dumps([record.source, len(record.images)]).encode())
                for image in record.images:
                    h.update(digest(image))
                found += len(record.images)
    return {"processor": processor_hash(processor), "images": h.hexdigest()} if found else None


def image_summary(split: dict[str, Any]) -> str | None:
    """prepare's line on a split's images (None without image stats)."""
    images = split.get("images")
    if not images:
        return None
    per = ", ".join(f"{n} with {k}" for k, n in images["images_per_record"].items())
    return (
        f"    images per record: {per}; image tokens {images['image_tokens']} "
        f"({100 * images['image_token_share']:.1f}% of the tokens)"
    )


def no_typed_image_tokens(
    processor: Any, on_bad_record: str, train: list[Record], evaluation: list[Record]
) -> tuple[list[Record], list[Record], list[RecordError]]:
    """(train records, eval records, the records refused) of a text-only build: for a vision-language model
    (``processor`` from :func:`load_processor`), those holding its image token as text are bad records
    (:func:`coati_kto.data.images.typed_image_tokens`); for a text model, all kept."""
    if processor is None or isinstance(processor, UnloadableProcessor):
        return train, evaluation, []
    (train, train_typed), (evaluation, eval_typed) = (
        typed_image_tokens(records, processor, on_bad_record) for records in (train, evaluation)
    )
    return train, evaluation, train_typed + eval_typed
