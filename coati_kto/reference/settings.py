"""What the reference cache reads of the config, in one frozen object (the recipe builds it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coati_kto.config.kto import KTOSection
from coati_kto.config.schema import DataSection, ModelSection


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference model and how its log-probs are scored and keyed.

    ``model``: the reference is ``model.reference_path`` or ``model.path``, loaded with these options. ``data``:
    ``prepared_dir`` (the cache lives inside it) and the lengths (part of the key). ``kto``:
    ``precompute_batch_size``, and ``kl_continuation`` and ``policy_packing()``, which decide how the KL pairs
    are scored (as the policy's training passes will). ``dtype``: the run's working dtype (``ParallelPlan.dtype``).
    """

    model: ModelSection
    data: DataSection
    kto: KTOSection
    dtype: torch.dtype
