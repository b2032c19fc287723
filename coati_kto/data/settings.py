"""What building and opening ``data.prepared_dir`` read of the config, in one frozen object.

The recipe and the CLI build it from their config; the data package reads nothing else of it (the KTO weight
report has its own: :class:`coati_kto.data.weights.WeightSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass

from coati_kto.config.schema import DataSection, ModelSection


@dataclass(frozen=True)
class PrepareSettings:
    """The prepared data's inputs besides the files and the tokenizer's content.

    ``data``: every ``data.*`` key. ``model``: the tokenizer to load, ``model.path``'s generation EOS ids (a chat
    completion ending with one gets no EOS) and the vocabulary and positions both checkpoints hold. ``seed``:
    ``train.seed``, which draws the eval split and the KL pairing. ``images``: image records are read where
    ``model.path`` is a vision-language model (prepare, inspect and train: :mod:`coati_kto.data.image_store`).
    """

    data: DataSection
    model: ModelSection
    seed: int
    images: bool = False
