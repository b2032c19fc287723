"""Image feedback, the model side (docs/image_feedback_plan.md §9 steps 1 and 5), on the tiny vision-language
models of coati_kto.testing.tiny (fp32, one process), their pixels built by each family's PIL image processor from
its defaults as the plan's §2 table says:

- an image changes the completion's logits (Gemma 3's projector, zero in transformers, gave exactly 0.0), and
  each tower projects into the text model's width;
- the image features, computed once (coati_kto.models.vision), give the example view and its KL view the
  log-probs of the plain ``pixel_values`` forward, with no gradient into a frozen tower or projector.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from helpers import CORPUS
from PIL import Image

from coati_kto.data.collator import KTOCollator
from coati_kto.models.hf import freeze_vision_tower
from coati_kto.models.lm_head import model_sequence_logps
from coati_kto.models.vision import (
    VisionInputs,
    image_features,
    tower_trainable,
    vision_family,
    vision_keywords,
)
from coati_kto.testing.image_rows import stored
from coati_kto.testing.tiny import build_family_model, build_tokenizer
from coati_kto.testing.tiny_processors import crossed_rows

FAMILIES = ["gemma3_vl", "gemma4_vl", "qwen3_5_vl"]
# The multimodal tokens of each family's tokenizer (named as its processor reads them: tokenizer.image_token...).
TOKENS = {
    "gemma3_vl": {
        "image_token": "<image_soft_token>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
    },
    "gemma4_vl": {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"},
    "qwen3_5_vl": {
        "image_token": "<|image_pad|>",
        "video_token": "<|video_pad|>",
        "vision_start_token": "<|vision_start|>",
        "vision_end_token": "<|vision_end|>",
    },
}


def _tokenizer(family: str) -> transformers.PreTrainedTokenizerFast:
    """The suite's tiny BPE with ``family``'s multimodal tokens added and named."""
    base = build_tokenizer(CORPUS * 4, vocab_size=300)
    base.add_special_tokens({"extra_special_tokens": list(TOKENS[family].values())})
    named = dict(bos_token=base.bos_token, eos_token=base.eos_token, pad_token=base.pad_token)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, extra_special_tokens=TOKENS[family], **named
    )


def _image(seed: int, size: tuple[int, int] = (32, 32)) -> Image.Image:
    """Random RGB pixels."""
    pixels = torch.rand(size[1], size[0], 3, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray((pixels * 255).to(torch.uint8).numpy())


def _pixels(family: str, images: list[Image.Image]) -> tuple[list[int], dict[str, torch.Tensor]]:
    """(image tokens per image, the tower's inputs) from ``family``'s PIL image processor (plan §2)."""
    if family == "gemma3_vl":
        out = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})(
            images, return_tensors="pt"
        )
        return [4] * len(images), {"pixel_values": out["pixel_values"]}
    if family == "gemma4_vl":
        processor = transformers.Gemma4ImageProcessorPil(
            max_soft_tokens=70, patch_size=4, pooling_kernel_size=2
        )
        out = processor(images, return_tensors="pt")
        tower = {k: out[k] for k in ("pixel_values", "image_position_ids")}
        return [int(n) for n in out["num_soft_tokens_per_image"]], tower
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=32**2, max_pixels=64**2
    )
    out = processor(images, return_tensors="pt")
    tower = {k: out[k] for k in ("pixel_values", "image_grid_thw")}
    return [int(g.prod()) // 4 for g in out["image_grid_thw"]], tower  # patches merged 2 x 2


def _prompt(tokenizer: Any, image_tokens: int, question: str) -> list[int]:
    image = tokenizer.image_token_id
    return [
        tokenizer.bos_token_id,
        *tokenizer.encode(question),
        *[image] * image_tokens,
        *tokenizer.encode("?"),
    ]


def _text_width(model: Any) -> int:
    return model.config.get_text_config().hidden_size


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_changes_the_completion_logits_and_the_tower_is_as_wide_as_the_text(family: str) -> None:
    """Gemma 3's projector started at zero in transformers: another image gave exactly the same logits (0.0)."""
    tokenizer = _tokenizer(family)
    model = build_family_model(family, tokenizer).eval()
    (tokens,), first = _pixels(family, [_image(1)])
    _, second = _pixels(family, [_image(2)])
    ids = torch.tensor([_prompt(tokenizer, tokens, "What colour is the shape") + tokenizer.encode(" red")])
    types = {vision_family(model.config).token_types: (ids == tokenizer.image_token_id).long()}
    with torch.no_grad():
        logits = [model(input_ids=ids, use_cache=False, **image, **types).logits for image in (first, second)]
        features = image_features(model, VisionInputs(token_types=types.popitem()[1], **first)).pooler_output
    # from the position that predicts the completion's first token
    completion = ids.shape[1] - len(tokenizer.encode(" red")) - 1
    moved = float((logits[0][:, completion:] - logits[1][:, completion:]).abs().max())
    print(f"{family}: another image moves the completion logits by {moved:.3g}")
    assert moved > 1e-3
    features = features if isinstance(features, tuple) else (features,)
    assert [f.shape[-1] for f in features] == [_text_width(model)]
    if family == "qwen3_5_vl":
        assert model.config.vision_config.out_hidden_size == _text_width(model)


def _batch(family: str, tokenizer: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Two prompts, each with its own image (of another size for Qwen 3.5: another grid), completions of other
    lengths; each KL row pairs prompt i with the other row's completion. (KTOBatch, the tower's inputs)."""
    sizes = [(32, 32), (48, 32) if family == "qwen3_5_vl" else (32, 32)]
    counts, tower = _pixels(family, [_image(1, sizes[0]), _image(2, sizes[1])])
    prompts = [
        _prompt(tokenizer, counts[0], "What colour is it"),
        _prompt(tokenizer, counts[1], "Which colour"),
    ]
    answers = [
        tokenizer.encode(" red" + tokenizer.eos_token),
        tokenizer.encode(" a green one" + tokenizer.eos_token),
    ]
    return KTOCollator(tokenizer.pad_token_id)(crossed_rows(prompts, answers)), tower


class _Counted:
    """``get_image_features`` of ``model``'s inner model, counting its calls (the forward's own included)."""

    def __init__(self, model: Any) -> None:
        self.inner, self.calls = model.model, 0
        self.original = self.inner.get_image_features
        self.inner.get_image_features = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.original(*args, **kwargs)


def _logps(model: Any, batch: Any, vision: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    views = {"example": batch.example, "kl": batch.kl}
    return {
        name: model_sequence_logps(
            model, v.input_ids, v.attention_mask, v.loss_mask, None, v.keep, v.targets(), vision=vision[name]
        )
        for name, v in views.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_one_feature_pass_gives_both_views_the_pixel_values_log_probs(family: str) -> None:
    tokenizer = _tokenizer(family)
    model = build_family_model(family, tokenizer)
    freeze_vision_tower(model)  # as training loads it (coati_kto.models.hf)
    model.train()
    assert not tower_trainable(model)
    batch, tower = _batch(family, tokenizer)
    key = vision_family(model.config).token_types
    inputs = {
        name: VisionInputs(token_types=(view.input_ids == tokenizer.image_token_id).long(), **tower)
        for name, view in (("example", batch.example), ("kl", batch.kl))
    }
    counted = _Counted(model)
    features = image_features(model, inputs["example"])
    assert features.pooler_output[0].grad_fn is None  # a constant: the frozen tower is out of the graph
    shared = _logps(model, batch, {n: vision_keywords(model.config, v, features) for n, v in inputs.items()})
    assert counted.calls == 1  # one tower pass served both views
    with torch.no_grad():
        plain = _logps(model, batch, {n: {**tower, key: v.token_types} for n, v in inputs.items()})
    assert counted.calls == 3  # the plain forwards ran the tower once each
    for name in shared:
        diff = float((shared[name].detach() - plain[name]).abs().max())
        print(f"{family} {name}: log-probs {shared[name].tolist()}, shared vs pixel_values {diff:.3g}")
        assert torch.equal(shared[name], plain[name])  # 0.0 measured: the same computation
    assert not torch.equal(shared["example"], shared["kl"])
    (shared["example"] + shared["kl"]).sum().backward()
    text = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    outside = [n for n, p in model.named_parameters() if id(p) not in text]
    assert outside and all(model.get_parameter(n).grad is None for n in outside)
    assert any(p.grad is not None and p.grad.abs().max() > 0 for p in model.get_decoder().parameters())


def test_a_trainable_tower_takes_the_pixel_values_gradient_through_shared_features() -> None:
    """With the tower trained (not frozen), the features keep its graph: one backward through both views gives
    the tower the gradient of the two plain forwards."""
    tokenizer = _tokenizer("gemma3_vl")
    model = build_family_model("gemma3_vl", tokenizer).train()
    assert tower_trainable(model)
    batch, tower = _batch("gemma3_vl", tokenizer)
    inputs = {
        name: VisionInputs(tower["pixel_values"], (view.input_ids == tokenizer.image_token_id).long())
        for name, view in (("example", batch.example), ("kl", batch.kl))
    }
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    features = image_features(model, inputs["example"])
    shared = _logps(model, batch, {n: vision_keywords(model.config, v, features) for n, v in inputs.items()})
    (shared["example"] + shared["kl"]).sum().backward()
    got, projector.grad = projector.grad.clone(), None
    plain = _logps(model, batch, {n: {**tower, "token_type_ids": v.token_types} for n, v in inputs.items()})
    (plain["example"] + plain["kl"]).sum().backward()
    assert got.abs().max() > 0
    torch.testing.assert_close(got, projector.grad, atol=1e-6, rtol=1e-5)


def test_vision_inputs_a_family_cannot_take_are_refused() -> None:
    with pytest.raises(ValueError) as text_only:
        vision_family(transformers.LlamaConfig())
    assert (
        str(text_only.value)
        == "images need a vision-language model of gemma3, gemma4, qwen3_5; this one is 'llama'"
    )
    tokenizer = _tokenizer("qwen3_5_vl")
    model = build_family_model("qwen3_5_vl", tokenizer)
    no_grid = VisionInputs(
        pixel_values=torch.zeros(16, 1176), token_types=torch.zeros(1, 4, dtype=torch.long)
    )
    with pytest.raises(ValueError) as missing:
        image_features(model, no_grid)
    assert str(missing.value) == "the vision inputs lack image_grid_thw, which this family's forward reads"


def test_the_tiny_gemma3_processor_feeds_the_tiny_gemma3_vl_model() -> None:
    """The data side's processor (coati_kto.testing.tiny_processors) and this model agree on the image token, the
    vocabulary and the pixels: its output runs the model, and its image moves the logits."""
    from coati_kto.testing.tiny_processors import gemma3_processor

    processor = gemma3_processor()
    tokenizer = processor.tokenizer
    model = build_family_model("gemma3_vl", tokenizer).eval()
    assert model.config.image_token_index == tokenizer.image_token_id
    assert model.config.get_text_config().vocab_size == len(tokenizer)
    text = [f"What colour is {processor.image_token} this? red"]
    with torch.no_grad():
        logits = [
            model(
                **processor(text=text, images=[[_image(seed)]], return_tensors="pt"), use_cache=False
            ).logits
            for seed in (1, 2)
        ]
    assert float((logits[0][:, -3:] - logits[1][:, -3:]).abs().max()) > 1e-3


def test_a_collated_gemma3_batch_gives_both_views_their_log_probs_from_one_tower_pass() -> None:
    """The data side's collator (KTOCollator with the tiny Gemma 3 processor's image processor) and this side's
    features: its ``KTOBatch.images`` (``view_inputs``) score both views as the plain ``pixel_values`` forward."""
    import io

    from coati_kto.models.vision import view_inputs
    from coati_kto.testing.tiny_processors import gemma3_processor

    processor = gemma3_processor()
    tokenizer = processor.tokenizer
    model = build_family_model("gemma3_vl", tokenizer)
    freeze_vision_tower(model)
    pngs = []
    for seed in (1, 2):
        png = io.BytesIO()
        _image(seed).save(png, format="PNG")
        pngs.append(png.getvalue())
    questions = [
        f"What colour is {processor.image_token} this?",
        f"Which colour has {processor.image_token}?",
    ]
    prompts = [
        processor(text=[q], images=[[_image(s)]])["input_ids"][0]
        for q, s in zip(questions, (1, 2), strict=True)
    ]
    answers = [
        tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
        for a in (" red", " a blue one")
    ]
    rows, table = stored(crossed_rows(prompts, answers, pngs))
    collate = KTOCollator(
        tokenizer.pad_token_id,
        image_processor=processor.image_processor,
        image_token_id=tokenizer.image_token_id,
        image_seq_length=processor.image_seq_length,
        image_table=table,
    )
    batch = collate(rows)
    inputs = view_inputs(batch.images)
    counted = _Counted(model)
    features = image_features(model, inputs["example"])
    shared = _logps(model, batch, {n: vision_keywords(model.config, v, features) for n, v in inputs.items()})
    assert counted.calls == 1
    with torch.no_grad():
        plain = _logps(
            model,
            batch,
            {n: {"pixel_values": v.pixel_values, "token_type_ids": v.token_types} for n, v in inputs.items()},
        )
    for name in shared:
        assert torch.equal(shared[name], plain[name])
    assert not torch.equal(shared["example"], shared["kl"])
