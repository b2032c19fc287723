"""The step's passes on image rows (issue 49, docs/image_feedback_plan.md §4), one process, fp32, on the tiny
Gemma 3 VL model and its processor (coati_kto.testing.tiny_processors), batches from the data side's collator:

- the image features are computed once per micro-batch and shared by the example view, the KL view, the policy
  and a reference of the same weights (a reference of other weights computes its own, once);
- the trained passes' per-row log-probs equal the plain ``pixel_values`` forward's, and at step 1 the online
  reference gives rewards and KL of exactly 0;
- the frozen tower and projector get no gradient and no optimizer state; with ``model.train_vision`` they get the
  plain forward's gradient, and the reference computes its own features.
"""

from __future__ import annotations

import copy
import io
import types
from typing import Any

import pytest
import torch
from PIL import Image

from coati_kto.data.collator import KTOCollator
from coati_kto.models.hf import freeze_vision_tower
from coati_kto.models.lm_head import LMHead
from coati_kto.models.packing import padded_logps
from coati_kto.models.vision import image_features
from coati_kto.testing.image_rows import stored
from coati_kto.testing.tiny import build_family_model
from coati_kto.testing.tiny_processors import gemma3_processor
from coati_kto.trainer.loss import preference_loss
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.passes import KTOPasses
from coati_kto.trainer.shared_vision import shared_vision

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (90, 30, 200), (0, 0, 0)]


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buf, "PNG")
    return buf.getvalue()


def _rows(processor: Any, n: int) -> list[dict]:
    """``n`` prepared-style rows: one image each, prompt i's ids from the processor, completions from the corpus."""
    tokenizer = processor.tokenizer
    words = ["red", "green", "blue", "yellow", "purple", "black"]
    rows = []
    for i in range(n):
        image = Image.open(io.BytesIO(_png(COLOURS[i])))
        text = f"Which colour is {processor.image_token} number {i}?"
        prompt = processor(text=[text], images=[[image]])["input_ids"][0]
        completion = tokenizer(f" {words[i]} it is", add_special_tokens=False)["input_ids"]
        kl = tokenizer(f" {words[(i + 1) % n]}", add_special_tokens=False)["input_ids"]
        rows.append(
            {
                "input_ids": prompt + completion,
                "completion_start": len(prompt),
                "label": i % 2 == 0,
                "kl_input_ids": prompt + kl,
                "kl_completion_start": len(prompt),
                "images": [_png(COLOURS[i])],
            }
        )
    return rows


class _Counted:
    """Counts the calls of a model's ``get_image_features`` (the tower and projector)."""

    def __init__(self, model: Any) -> None:
        self.calls, self._inner = 0, model.get_image_features
        model.get_image_features = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self._inner(*args, **kwargs)


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    processor = gemma3_processor()
    policy = build_family_model("gemma3_vl", processor.tokenizer, seed=0)
    freeze_vision_tower(policy)
    rows, table = stored(_rows(processor, 6))
    collator = KTOCollator(
        processor.tokenizer.pad_token_id,
        image_processor=processor.image_processor,
        image_token_id=processor.tokenizer.image_token_id,
        image_seq_length=processor.image_seq_length,
        image_table=table,
    )
    return {"policy": policy, "collator": collator, "batches": [collator(rows[:3]), collator(rows[3:])]}


def _passes(policy: Any, reference: Any, same_weights: bool) -> KTOPasses:
    backend = types.SimpleNamespace(forward_collectives=False, chunked_head=True)
    plan = types.SimpleNamespace(plugin="zero", backend=backend, tp_size=1, sp_size=1)
    options = KTOOptions(
        beta=0.5, reference_is_policy_weights=same_weights
    )  # kl_continuation on: the default
    return KTOPasses(policy, reference, plan, options, None, torch.device("cpu"))


def _tower(model: Any) -> list[torch.nn.Parameter]:
    inner = model.model
    return [*inner.vision_tower.parameters(), *inner.multi_modal_projector.parameters()]


def _step(passes: KTOPasses, batches: list[Any]) -> tuple[list[Any], StepSums]:
    sums, outputs = StepSums(torch.device("cpu")), []
    for micro in passes.train_step([[batch] for batch in batches], sums):
        micro.loss().backward()
        outputs.append(micro.outputs)
    return outputs, sums


def test_one_feature_pass_per_micro_batch_serves_every_view_and_step_1_is_exactly_zero(setup: dict) -> None:
    policy = copy.deepcopy(setup["policy"]).train()
    reference = copy.deepcopy(setup["policy"]).eval()
    counted = _Counted(policy), _Counted(reference)
    passes = _passes(policy, reference, same_weights=True)
    plans = [passes.scoring_plan(batch, True, alone=True) for batch in setup["batches"]]
    # kl_continuation is on, but a batch with images runs the padded KL pass (no continuation, z0 per group).
    assert {(p.policy_kl, p.reference, p.z0) for p in plans} == {("separate", "separate", "group")}
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    outputs, sums = _step(passes, setup["batches"])
    assert [c.calls for c in counted] == [2, 0]  # once per micro-batch, the reference shares them
    for _, rewards, _ in outputs:
        assert torch.equal(rewards, torch.zeros_like(rewards))
    assert sums.local()[1] == {"kl": 0.0, "kl_raw": 0.0}
    # The trained passes' log-probs: the plain pixel_values forward's (the tower run inside the forward).
    head = LMHead.find(policy)
    for batch, (_, _, logps) in zip(setup["batches"], outputs, strict=True):
        vision = {
            "pixel_values": batch.images.pixel_values,
            "token_type_ids": batch.images.example_token_types,
        }
        with torch.no_grad():
            plain = padded_logps(policy, batch.example, head, vision)
        assert torch.equal(logps.detach(), plain), (logps, plain)
    assert all(p.grad is None for p in _tower(policy))
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    optimizer.step()
    tower = {id(p) for p in _tower(policy)}
    assert len(optimizer.state) > 0 and not tower & {id(p) for p in optimizer.state}
    passes.evaluate(setup["batches"])  # one feature pass per evaluation batch too
    assert [c.calls for c in counted] == [4, 0]


def test_a_reference_of_other_weights_computes_its_own_features_once(setup: dict) -> None:
    policy = copy.deepcopy(setup["policy"]).train()
    processor = gemma3_processor()
    reference = build_family_model("gemma3_vl", processor.tokenizer, seed=1).eval()  # model.reference_path
    freeze_vision_tower(reference)
    counted = _Counted(policy), _Counted(reference)
    outputs, sums = _step(_passes(policy, reference, same_weights=False), setup["batches"])
    assert [c.calls for c in counted] == [2, 2]
    assert all(float(rewards.abs().max()) > 0 for _, rewards, _ in outputs)  # another model: nonzero rewards


def _kto_grads(policy: Any, reference: Any, batches: list[Any], beta: float) -> list[torch.Tensor]:
    """The tower's and projector's gradients of the step's KTO loss by plain autograd: each micro-batch's
    ``pixel_values`` forward (the tower run inside it), z0 0 (step 1: the policy is the reference)."""
    head, rows = LMHead.find(policy), sum(len(batch) for batch in batches)
    for batch in batches:
        vision = {
            "pixel_values": batch.images.pixel_values,
            "token_type_ids": batch.images.example_token_types,
        }
        with torch.no_grad():
            reference_logps = padded_logps(reference, batch.example, LMHead.find(reference), vision)
        logps = padded_logps(policy, batch.example, head, vision)
        losses, _ = preference_loss("kto", logps, reference_logps, batch.label.bool(), torch.zeros(()), beta)
        (losses.sum() / rows).backward()
    return [p.grad for p in _tower(policy)]


def test_train_vision_trains_the_tower_through_the_example_pass_and_the_reference_keeps_its_own(
    setup: dict,
) -> None:
    """model.train_vision: the gradient pass recomputes the features with a graph, so the tower and projector get
    the KTO loss's gradient (the plain pixel_values forward's); the reference computes its own features, which
    differ from the policy's once the optimizer has stepped."""
    policy = copy.deepcopy(setup["policy"]).train()
    for parameter in _tower(policy):
        parameter.requires_grad_(True)  # build_components skips freeze_vision_tower
    reference = copy.deepcopy(setup["policy"]).eval().requires_grad_(False)
    plain = copy.deepcopy(policy)
    counted = _Counted(policy), _Counted(reference)
    passes = _passes(policy, reference, same_weights=True)
    outputs, sums = _step(passes, setup["batches"])
    # The policy's: a no-grad pass and the gradient pass per micro-batch; the reference's own, once each.
    assert [c.calls for c in counted] == [4, 2]
    for _, rewards, _ in outputs:
        assert torch.equal(rewards, torch.zeros_like(rewards))
    assert sums.local()[1] == {"kl": 0.0, "kl_raw": 0.0}
    grads = [p.grad for p in _tower(policy)]
    expected = _kto_grads(plain, reference, setup["batches"], beta=0.5)
    # The parameters the forward reaches (not the vision model's unused head): the same ones in both.
    assert [g is None for g in grads] == [g is None for g in expected]
    reached = [(got, want) for got, want in zip(grads, expected, strict=True) if want is not None]
    assert len(reached) > 0 and all(float(got.abs().sum()) > 0 for got, _ in reached)
    for got, want in reached:
        assert float((got - want).norm()) <= 1e-6 * float(want.norm()), (got, want)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    optimizer.step()
    assert {id(p) for p in _tower(policy) if p.grad is not None} <= {id(p) for p in optimizer.state}
    vision = shared_vision(setup["batches"][0], policy, reference, passes.options)
    assert [c.calls for c in counted] == [5, 3]
    ours, theirs = (vision.features[id(m)].pooler_output for m in (policy, reference))
    assert not torch.equal(ours, theirs)
    with torch.no_grad():  # the reference's are its own weights': the step-0 tower's
        assert torch.equal(theirs, image_features(plain, vision.inputs["example"]).pooler_output)
