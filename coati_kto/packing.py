"""Reference log-probs of an example and its KL pair.

(Two passes for now; the shared-prompt single pass comes next.)
"""

from __future__ import annotations

from typing import Any

import torch

from coati_kto.logprobs import LMHead, model_sequence_logps


def reference_pair_logps(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(example log-probs [B], KL-pair log-probs [B]) fp32 of ``model`` on a batch of the batch contract."""
    head = LMHead.find(model)
    example = model_sequence_logps(
        model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], head
    )
    kl = model_sequence_logps(
        model, batch["kl_input_ids"], batch["kl_attention_mask"], batch["kl_loss_mask"], head
    )
    return example, kl
