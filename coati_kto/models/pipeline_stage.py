"""The last pipeline stage's scoring: completion log-probs from the decoder's normed hidden states.

Under pipeline parallelism (``plugin.pp_size`` > 1) the last stage's forward ends at the final norm
(``coati_kto.families.shardformer.pipeline.stage_forward``); the pipeline's criterion, on that stage only, turns
its hidden states into the per-row completion log-probs with the project's log-prob head, as the unsplit passes
do (the chunked head where the model has one: no [mb, K, V] logits).
"""

from __future__ import annotations

import torch
from torch import nn

from coati_kto.families import text_vocab_size
from coati_kto.models.lm_head import LMHead
from coati_kto.models.logit_means import LogitMeans, recording
from coati_kto.models.logprobs import completion_logits_to_keep, hidden_sequence_logps, sequence_logps


def stage_logps(
    model: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, record: bool
) -> tuple[torch.Tensor, LogitMeans | None]:
    """(completion log-probs [mb] fp32, with ``record`` the rows' logit means) of ``model`` (the causal LM, the
    last stage's) from ``hidden`` [mb, S, H]; only the last K positions, from the first completion token on, are
    projected. Gradient flows to ``hidden`` and the head."""
    keep = completion_logits_to_keep(loss_mask)
    kept = hidden[:, hidden.shape[1] - keep :]
    head = LMHead.find(model)
    with recording(LogitMeans() if record else None) as means:
        if head is not None:
            logps = hidden_sequence_logps(
                kept, head.weight, head.bias, input_ids, loss_mask, compiled=head.compiled
            )
        else:
            # A padded vocabulary's extra columns are no tokens: normalise over the real vocabulary only.
            logits = model.lm_head(kept)[..., : text_vocab_size(model.config)]
            logps = sequence_logps(logits, input_ids, loss_mask)
    return logps, means
