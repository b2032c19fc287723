"""KTOTrainer's settings arrive as one KTOOptions; ColossalChat's positional signature is a thin adapter onto it."""

from __future__ import annotations

import pytest
import torch

from coati_kto.parallel.distributed import ParallelLayout
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.trainer.options import KTOOptions


def _trainer(*args, **kwargs):
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.testing.tiny import random_causal_lm
    from coati_kto.trainer.kto import KTOTrainer

    policy = random_causal_lm(LlamaForCausalLM, LlamaConfig)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, dp_group=None)
    plan = ParallelPlan(plugin="ddp", precision="fp32", zero_stage=0)
    return KTOTrainer(
        policy, None, None, optimizer, None, None, None, *args, layout=layout, plan=plan, **kwargs
    )


def test_colossalchat_positional_signature_still_builds() -> None:
    """ColossalChat's order: max_epochs, beta, desirable_weight, undesirable_weight, apply_loss_mask,
    accumulation_steps, start_epoch, save_interval, save_dir, coordinator; every setting lands in the options
    the step reads (the passes read beta and the weights from there, not from a tuple beside them)."""
    trainer = _trainer(3, 0.25, 1.5, 0.75, False, 4, 1, 7, None, object(), loss_type="apo_zero_unpaired")
    assert trainer.options == KTOOptions(
        max_epochs=3,
        beta=0.25,
        desirable_weight=1.5,
        undesirable_weight=0.75,
        apply_loss_mask=False,
        accumulation_steps=4,
        save_interval=7,
        loss_type="apo_zero_unpaired",
    )
    assert (trainer.max_epochs, trainer.start_epoch, trainer.accumulation_steps, trainer.save_interval) == (
        3,
        1,
        4,
        7,
    )
    assert trainer.passes.options is trainer.options
    assert trainer.position.accumulation_steps == 4


def test_options_alone_and_both_ways_at_once() -> None:
    options = KTOOptions(beta=0.5, accumulation_steps=2, max_epochs=2)
    assert _trainer(options=options).options is options
    with pytest.raises(TypeError) as err:
        _trainer(1, options=options, kl_scope="micro_batch")
    assert str(err.value) == "KTOTrainer: settings both in options and as arguments: kl_scope, max_epochs"


def test_settings_out_of_range_are_refused_by_the_options() -> None:
    with pytest.raises(ValueError, match=r"^accumulation_steps must be >= 1, save_interval >= 0$"):
        KTOOptions(accumulation_steps=0)
    with pytest.raises(ValueError, match=r"^accumulation_steps must be >= 1, save_interval >= 0$"):
        _trainer(save_interval=-1)
