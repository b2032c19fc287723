"""A run on image records (issue 49): what it refuses, the note on what it turns off, and the collator's image
keywords from ``model.path``'s processor (docs/image_feedback_plan.md §4).

Image rows run padded passes only: a packed row's 4D mask has no image block, the KL continuation's positions
know none, and the pipeline schedule splits every batch tensor along its rows (pixel values are not rows). What
the user asked for explicitly is refused in one line; what is on by default (``kto.kl_continuation``,
``kto.pack_policy: auto``) falls back to the padded KL pass, said once in the run's notes.
"""

from __future__ import annotations

from typing import Any

from coati_kto.config.schema import Config
from coati_kto.data.image_store import collator_images
from coati_kto.errors import ConfigError
from coati_kto.models.compile import wants_compile


def has_images(data: Any) -> bool:
    """Whether the prepared rows hold images (``coati_kto.data.image_store``): the train split decides."""
    return "images" in data.train.column_names


def image_refusal(config: Config) -> str | None:
    """The first setting that cannot run on image records, as one line (None: the run can); sequence parallelism
    before the padding-free rows it needs."""
    plugin, kto = config.plugin, config.kto
    checks = (
        (plugin.sp_size > 1, f"plugin.sp_size {plugin.sp_size}", "padding-free rows sliced per rank", "1"),
        (
            config.data.padding_free,
            "data.padding_free true",
            "packed rows: their masks have no image block",
            "false",
        ),
        (
            kto.pack_policy is True,
            "kto.pack_policy true",
            "a packed pass: its mask has no image block",
            "auto",
        ),
        (
            kto.pack_reference,
            "kto.pack_reference true",
            "a packed pass: its mask has no image block",
            "false",
        ),
        (
            getattr(plugin, "pp_size", 1) > 1,
            f"plugin.pp_size {getattr(plugin, 'pp_size', 1)}",
            "micro-batches split along rows (pixel values are not rows)",
            "1",
        ),
        (
            wants_compile(config.model.compile),
            f"model.compile {str(config.model.compile).lower()}",
            "compiled layers",
            "false",
        ),
    )
    for refused, setting, why, fix in checks:
        if refused:
            return f"{setting}: image records cannot run with {why}; set it to {fix}"
    return None


def image_collator(config: Config, data: Any) -> tuple[dict[str, Any], str | None]:
    """The ``KTOCollator`` image keywords (empty without images; ``image_table``: ``data``'s images, which the
    rows reference) and the one-line note on the passes turned off for images (None when none is). ConfigError
    (one line) for a setting images cannot run with."""
    if not has_images(data):
        return {}, None
    refusal = image_refusal(config)
    if refusal is not None:
        raise ConfigError(refusal)
    kto = config.kto
    off = [
        name
        for name, on in (
            ("kto.kl_continuation", kto.kl_continuation),
            ("kto.pack_policy auto", kto.policy_packing()),
        )
        if on
    ]
    note = None
    if off and kto.loss_type != "apo_zero_unpaired":
        note = f"{' and '.join(off)}: off for image records (the KL pairs run their own padded pass with the images)"
    return {**collator_images(config.model), "image_table": data.images}, note
