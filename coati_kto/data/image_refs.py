"""A record's ``images`` (TRL's vision-language format) -> the bytes of each image, checked.

An image reference is one of: a path (relative to the data file's folder, absolute, or from ``~``; in a Hub
dataset only its own files as datasets downloaded them, as any other path names a file on this machine), raw
bytes, or a
``{"bytes", "path"}`` struct, as ``datasets``' ``Image`` feature stores it in parquet (bytes first, the path
when the bytes are null). Each image must open and decode with PIL. Every problem is a one-line
:class:`~coati_kto.data.formats.RecordError` naming the record and the field (``images[i]``).

The number of images must equal the number of ``{"type": "image"}`` parts over the prompt's messages: the
processor puts the i-th image at the i-th placeholder.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from coati_kto.data.formats import Record, RecordError, show_value

# References that name no file: data URIs and URLs are not fetched (a run reads its data from disk).
NOT_FILES = ("data:", "http://", "https://", "s3://", "gs://", "hf://")

# The content-part types a message may hold when images are read (TRL's vision-language format).
PART_TYPES = ("image", "text")


def image_parts(messages: list[dict[str, Any]]) -> int:
    """The number of ``{"type": "image"}`` parts over ``messages`` (string contents hold none)."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image"
    )


def digest(image: bytes) -> bytes:
    """The sha256 of an image's bytes: what tells two prompts with the same text and other images apart."""
    return hashlib.sha256(image).digest()


def _downloaded(ref: str) -> bool:
    """``ref`` is a file datasets downloaded for a Hub dataset (an imagefolder repo's images come as
    ``{"bytes": None, "path": <the downloaded copy>}``): an absolute path under the hub or datasets cache."""
    import datasets
    from huggingface_hub import constants

    path = Path(ref)
    if not path.is_absolute():
        return False
    real = path.resolve()
    roots = (constants.HF_HUB_CACHE, datasets.config.HF_DATASETS_CACHE)
    return any(real.is_relative_to(Path(root).expanduser().resolve()) for root in roots)


def _reference(ref: Any, source: str, where: str, base: Path | None) -> bytes:
    """The bytes ``ref`` names (see the module docstring); raises RecordError."""
    if hasattr(ref, "tolist") and not isinstance(ref, (bytes, bytearray)):  # numpy from a table
        ref = ref.tolist()
    if isinstance(ref, dict) and set(ref) <= {"bytes", "path"}:  # datasets' Image feature, undecoded
        ref = ref.get("bytes") if ref.get("bytes") is not None else ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if not isinstance(ref, str) or not ref:
        raise RecordError(
            source,
            where,
            f"expected a path, bytes or a {{'bytes', 'path'}} struct, got {show_value(ref)}",
            "bad_image",
        )
    if ref.startswith(NOT_FILES):  # a base64 string can be hundreds of KB: shown clipped
        raise RecordError(
            source,
            where,
            f"{show_value(ref)} is not read: image references are files (a path), bytes or a "
            "{'bytes', 'path'} struct; save it to a file and give its path",
            "bad_image",
        )
    # A Hub dataset's path names a file of its author's machine, or (absolute, ~) one of this machine's: only its
    # own files, as datasets downloaded them, are read.
    if base is None and not _downloaded(ref):
        raise RecordError(
            source,
            where,
            f"an image path {show_value(ref)} in a Hub dataset: its images are read as bytes or from its own "
            "downloaded files only (any other path names a file on this machine)",
            "missing_image",
        )
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = base / path
    shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:197]}..."
    try:
        found = path.is_file()
    except PermissionError as err:  # a folder on the way the process may not search: this record only
        raise RecordError(
            source, where, f"cannot read image file {shown} ({err.strerror or err})", "unreadable_image"
        ) from None
    except OSError as err:  # a name over the file system's limit (a base64 string without a scheme)
        raise RecordError(
            source, where, f"{show_value(ref)} is not a usable path ({err.strerror or err})", "bad_image"
        ) from None
    if not found:
        raise RecordError(source, where, f"no such image file: {shown}", "missing_image")
    try:
        return path.read_bytes()
    except OSError as err:  # no read permission, an I/O error, a file gone since is_file: this record only
        raise RecordError(
            source, where, f"cannot read image file {shown} ({err.strerror or err})", "unreadable_image"
        ) from None


# Modes of more than 8 bits a channel: processors clip them to 8 bits (a 16-bit mid-grey PNG becomes white).
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
# Formats whose further frames are not pictures of their own: a camera JPEG's MPF preview or depth map, PSD layers.
ONE_PICTURE = ("MPO", "PSD")


def decode_problem(image: bytes) -> tuple[str, str] | None:
    """None when PIL opens and decodes ``image`` whole (a truncated file fails in ``load``) into 8 bits a channel,
    as one picture; else (the problem, its reason) of the RecordError :func:`check_decodes` raises."""
    try:
        with Image.open(io.BytesIO(image)) as opened:
            opened.load()
            # An animation or a multi-page file in any format Pillow reads (an animated AVIF passed the list of
            # GIF, PNG, WebP and TIFF this was)
            frames = getattr(opened, "n_frames", 1) if opened.format not in ONE_PICTURE else 1
            mode = opened.mode
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, UnidentifiedImageError):  # its text names the BytesIO object's address
            first = "no image format PIL knows"
        return f"not an image PIL can open ({len(image)} bytes: {first[:120]})", "bad_image"
    if mode in WIDE_MODES:
        return (
            f"a {'float' if mode == 'F' else '16- or 32-bit integer'} image (PIL mode {mode}): image processors "
            "clip it to 8 bits a channel (a 16-bit mid-grey becomes white), so the model would see another "
            "picture; convert it to 8-bit",
            "bad_image",
        )
    if frames > 1:  # PIL, transformers' load_image and the processors all read the first frame alone
        return (
            f"an image of {frames} frames (an animation or a multi-page file): the model would see its first frame "
            "only, while the label judges the whole; save the frame meant as an image of its own",
            "bad_image",
        )
    return None


def check_decodes(
    image: bytes, source: str, where: str, checked: dict[bytes, tuple[str, str] | None] | None = None
) -> None:
    """Raise RecordError unless ``image`` decodes (:func:`decode_problem`). ``checked``: each image's outcome by
    its :func:`digest`, filled here: an image many records share (several completions rated per image) is
    decoded once, and each of its records gets its outcome (a bad one names every record)."""
    if checked is None:
        problem = decode_problem(image)
    else:  # the outcome alone is kept (a few dozen bytes an image), never the pixels
        key = digest(image)
        if key not in checked:
            checked[key] = decode_problem(image)
        problem = checked[key]
    if problem is not None:
        raise RecordError(source, where, *problem)


def read_images(
    raw: Any,
    source: str,
    base: Path | None,
    parts: int,
    decode: bool = True,
    checked: dict[bytes, tuple[str, str] | None] | None = None,
) -> list[bytes]:
    """The checked bytes of a record's ``images`` field (``raw``: the field, None when absent); ``parts``: the
    image parts over its prompt's messages, which the count must equal; ``base``: the data file's folder;
    ``decode``: each image must decode with PIL (off for the fingerprint, which hashes the bytes only);
    ``checked``: the outcomes of the images decoded so far (:func:`check_decodes`)."""
    if hasattr(raw, "tolist") and not isinstance(raw, (bytes, bytearray)):
        raw = raw.tolist()
    refs = [] if raw is None else raw
    if not isinstance(refs, list):
        raise RecordError(source, "images", f"expected a list of images, got {show_value(refs)}", "bad_image")
    if len(refs) != parts:
        raise RecordError(
            source,
            "images",
            f"{len(refs)} image(s) for {parts} image part(s) in the prompt: each {{'type': 'image'}} part takes "
            "the next image, in order",
            "image_count",
        )
    out = []
    for i, ref in enumerate(refs):
        image = _reference(ref, source, f"images[{i}]", base)
        if decode:
            check_decodes(image, source, f"images[{i}]", checked)
        out.append(image)
    return out


def attach_images(
    records: list[Record],
    raw: Any,
    source: str,
    base: Path | None,
    decode: bool = True,
    checked: dict[bytes, tuple[str, str] | None] | None = None,
) -> None:
    """Set ``images`` of the records one raw record gave (a preference pair's two share one prompt) from its
    ``images`` field ``raw`` (None when absent); raises RecordError. ``decode``, ``checked``: as
    :func:`read_images`."""
    count = image_parts(records[0].prompt) if records[0].chat else 0
    found = read_images(raw, source, base, count, decode, checked)
    for record in records:
        record.images = found


def undecoded(ds: Any) -> Any:
    """``ds`` with every ``Image`` column (or list of images) read as ``{"bytes", "path"}`` structs, not PIL
    images: the bytes are what the records keep (and hash)."""
    import datasets

    def plain(feature: Any) -> Any:
        if isinstance(feature, datasets.Image):
            return datasets.Image(decode=False)
        if isinstance(feature, (datasets.List, datasets.LargeList)):
            return type(feature)(plain(feature.feature))
        return feature

    features = datasets.Features({k: plain(v) for k, v in ds.features.items()})
    return ds if features == ds.features else ds.cast(features)
