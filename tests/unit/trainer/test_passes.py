"""The step's loss scaling: every example of a step weighs the same, also when its micro-batches differ in size
(what the re-plan of an interrupted epoch deals after a resume on another layout or micro-batch size)."""

from __future__ import annotations

import types
from pathlib import Path

import torch

from coati_kto.data.collator import KTOCollator
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.passes import KTOPasses


def _rows(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        prompt = torch.randint(
            3, 60, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        completion = torch.randint(3, 60, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        kl = torch.randint(3, 60, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen)
        out.append(
            {
                "input_ids": prompt + completion.tolist(),
                "completion_start": len(prompt),
                "label": i % 2 == 0,
                "kl_input_ids": prompt + kl.tolist(),
                "kl_completion_start": len(prompt),
            }
        )
    return out


def _gradient(policy: torch.nn.Module, reference: torch.nn.Module, micro_batches: list[list[dict]]):
    """The policy's gradient and the logged mean loss of one step over ``micro_batches`` (one process)."""
    collate = KTOCollator(pad_token_id=0)
    backend = types.SimpleNamespace(forward_collectives=True, chunked_head=True)
    plan = types.SimpleNamespace(plugin="ddp", backend=backend, tp_size=1, sp_size=1)
    passes = KTOPasses(policy, reference, plan, KTOOptions(beta=0.3), None, torch.device("cpu"))
    policy.zero_grad()
    sums = StepSums(torch.device("cpu"))
    for micro in passes.train_step([[collate(mb) for mb in micro_batches]], sums):
        micro.loss().backward()
    local, _ = sums.local()
    grad = torch.cat([p.grad.flatten() for p in policy.parameters()])
    return grad, local["loss"] / local["examples"]


def test_micro_batches_of_different_sizes_weigh_every_example_the_same(
    tiny_model_dir: Path, reference_dir: Path
) -> None:
    """Sizes 4 and 3 in one step: each micro-batch's loss was divided by its own rows x 2, so the 3-row one's
    examples weighed 4/3 of the others' and the gradient was 10% off the logged mean loss's."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    rows = _rows(7)
    split, loss_split = _gradient(policy, reference, [rows[:4], rows[4:]])
    whole, loss_whole = _gradient(policy, reference, [rows])
    assert abs(loss_split - loss_whole) < 1e-6
    assert float((split - whole).norm() / whole.norm()) < 1e-5
