"""tp_size 2 equals tp_size 1 (fp32) on image rows (issue 49): Gemma 4 and Qwen 3.5 VL, the families with a
tensor-parallel vision-language policy (Gemma 3 VL has none and is refused above tp 1).

On 2 gloo processes, each rank trains the tp_size 2 model and an unsharded copy (tp_size 1) on the same collated
batch of two rows whose images differ in size (so in their image token counts), with plain SGD for three steps.
Both score the rows as training does: the frozen tower's features computed once
(``coati_kto.models.vision.image_features``, replicated on every rank) and handed to both views' padded forwards
(``vision_keywords``). The per-row log-probs of both views at every step and every weight after the steps must
agree within the tolerances of the text-only tp 2 = tp 1 test (tests/distributed/test_tp_equivalence.py).
Gemma 4's pad-row read (plan §3: a vocabulary-parallel shard indexed by the pad id) feeds nothing while
``input_ids`` are given (tests/unit/models/test_vision_features.py keeps that tripwire); here it would show as a
log-prob difference.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from helpers import step_all, weight_diffs
from PIL import Image

from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.tiny_processors import crossed_rows

STEPS = 3
# The text-only test's learning rates and tolerances (Gemma 4's tiny model amplifies fp32 rounding: lr 0.01 and
# 5e-5 on the log-probs there).
LR = {"gemma4_vl": 0.01, "qwen3_5_vl": 0.1}
LOGPS_TOLERANCE = {"gemma4_vl": 5e-5, "qwen3_5_vl": 1e-5}
WEIGHT_TOLERANCE = 1e-5


def _png(colour: tuple[int, int, int], width: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, 32), colour).save(buf, "PNG")
    return buf.getvalue()


def _rows(processor: Any) -> list[dict]:
    """Two rows as prepare stores them: a 32- and a 48-pixel-wide image, completions of other lengths, each KL
    row pairing prompt i with the other row's completion."""
    tokenizer = processor.tokenizer
    images = [_png((200, 30, 30), 32), _png((20, 40, 220), 48)]
    prompts = []
    for question, image in zip(("What colour is it?", "Which colour?"), images, strict=True):
        content = [{"type": "image"}, {"type": "text", "text": question}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        pil = Image.open(io.BytesIO(image))
        prompts.append(list(processor(text=[text], images=[[pil]])["input_ids"][0]))
    answers = [tokenizer.encode(a, add_special_tokens=False) for a in (" red", " a blue one")]
    return crossed_rows(prompts, answers, images)


def _logps(model: Any, batch: Any) -> dict[str, torch.Tensor]:
    """Both views' per-row completion log-probs, from one feature pass (as the trainer scores image rows)."""
    from coati_kto.models.lm_head import model_sequence_logps
    from coati_kto.models.vision import image_features, view_inputs, vision_keywords

    inputs = view_inputs(batch.images)
    features = image_features(model, inputs["example"])
    config = model.unwrap().config if hasattr(model, "unwrap") else model.config
    out = {}
    for name, view in (("example", batch.example), ("kl", batch.kl)):
        vision = vision_keywords(config, inputs[name], features)
        out[name] = model_sequence_logps(
            model,
            view.input_ids,
            view.attention_mask,
            view.loss_mask,
            None,
            view.keep,
            view.targets(),
            vision=vision,
        )
    return out


def _loss(logps: dict[str, torch.Tensor], tokens: int) -> torch.Tensor:
    """The negative log-likelihood of both views' completions per completion token (the text-only test's mean
    cross-entropy: gradients of its scale)."""
    return -(logps["example"].sum() + logps["kl"].sum()) / tokens


def _tp_vs_tp1_images(family: str) -> dict[str, Any]:
    from colossalai.booster import Booster

    from coati_kto.data.collator import KTOCollator
    from coati_kto.models.hf import freeze_vision_tower
    from coati_kto.parallel import upstream
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.testing.image_rows import stored
    from coati_kto.testing.tiny import build_family_model
    from coati_kto.testing.tiny_processors import PROCESSORS

    upstream.apply()
    processor = PROCESSORS[family]()
    tokenizer = processor.tokenizer
    model = build_family_model(family, tokenizer, seed=1)
    freeze_vision_tower(model)
    single = copy.deepcopy(model)
    plan = ParallelPlan("hybrid_parallel", "fp32", 0, tp_size=2, model_class=type(model).__name__)
    booster = Booster(plugin=plan.backend.build_plugin())
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR[family])
    single_optimizer = torch.optim.SGD([p for p in single.parameters() if p.requires_grad], lr=LR[family])
    model, optimizer, _ = plan.backend.boost(booster, model, optimizer, None)
    rows, table = stored(_rows(processor))
    collate = KTOCollator(
        tokenizer.pad_token_id,
        image_processor=processor.image_processor,
        image_token_id=tokenizer.image_token_id,
        image_table=table,
    )
    batch = collate(rows)
    image_tokens = batch.images.example_token_types.sum(1).tolist()
    tokens = int(batch.example.loss_mask.sum() + batch.kl.loss_mask.sum())
    logps_diffs, logps = [], []
    for _ in range(STEPS + 1):
        sharded, whole = _logps(model, batch), _logps(single, batch)
        logps_diffs.append(max(float((sharded[k] - whole[k]).detach().abs().max()) for k in whole))
        logps.append({k: v.tolist() for k, v in whole.items()})
        if len(logps) > STEPS:  # the log-probs after the last step: no more steps
            break
        booster.backward(_loss(sharded, tokens), optimizer)
        _loss(whole, tokens).backward()
        step_all(optimizer, single_optimizer)
    trained = model.unwrap().state_dict()  # gathered: a collective under tensor parallelism
    expected = single.state_dict()
    diffs = weight_diffs(trained, expected)
    return {
        "image_tokens": image_tokens,
        "logps": logps,
        "logps_diff": max(logps_diffs),
        "logps_diffs": logps_diffs,
        "weight_diff": max(diffs.values()),
        "worst": max(diffs, key=diffs.get),
        "missing": sorted(set(expected) - set(trained)),
    }


@pytest.mark.parametrize("family", list(LR))
def test_tp2_equals_tp1_with_images(family: str) -> None:
    for rank in run_distributed(_tp_vs_tp1_images, 2, family):
        print(family, rank)
        assert rank["missing"] == []
        assert len(set(rank["image_tokens"])) == 2  # the two images' token counts differ
        assert rank["logps"][0] != rank["logps"][-1]  # the steps moved the log-probs
        assert rank["logps_diff"] <= LOGPS_TOLERANCE[family], rank
        assert rank["weight_diff"] <= WEIGHT_TOLERANCE, rank
