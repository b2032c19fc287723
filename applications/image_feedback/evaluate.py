"""The demo's metric: held-out accuracy of picking an image's colour among the 4 colour words.

For each held-out image (``held_out.jsonl`` from make_data.py, images never in a training record) the model
scores the 4 completions "red", "green", "blue", "yellow" after the training prompt. The score is the completion's
log-prob summed over the tokens coati-kto trains on (the word and the end of turn), computed in fp32 through the
project's own path: ``coati_kto.models.vision.image_features`` once per image, then
``coati_kto.models.lm_head.model_sequence_logps(vision=...)``. The image counts as right when its colour has the
highest score. A model that ignores the image picks one colour for every image: 25%.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from make_data import COLOURS, prompt
from PIL import Image


@dataclass(frozen=True)
class Encoded:
    """Rows of (prompt with one image, completion), padded on the right: what model_sequence_logps reads."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S], 1 on completion tokens
    token_types: torch.Tensor  # [B, S], 1 on image tokens (Gemma 3's token_type_ids)
    pixel_values: torch.Tensor  # [B, 3, H, W], one image per row


def encode(processor: Any, images: list[Image.Image], answers: list[str]) -> Encoded:
    """Tokenize each (image, answer) as ``coati-kto prepare`` does: the chat template over prompt + completion,
    the completion being the tokens after the prompt rendered with its generation prompt."""
    rows, masks, types, pixels = [], [], [], []
    for image, answer in zip(images, answers, strict=True):
        messages = prompt()
        start = processor.apply_chat_template(messages, add_generation_prompt=True)
        whole = processor.apply_chat_template(messages + [{"role": "assistant", "content": answer}])
        if not whole.startswith(start):
            raise ValueError(f"the chat template renders the prompt differently before {answer!r}")
        n_prompt = len(processor(text=[start], images=[[image]])["input_ids"][0])
        out = processor(text=[whole], images=[[image]], return_tensors="pt")
        ids = out["input_ids"][0]
        rows.append(ids)
        masks.append(torch.arange(len(ids)) >= n_prompt)
        types.append(out["token_type_ids"][0])
        pixels.append(out["pixel_values"])
    width = max(len(r) for r in rows)
    pad = processor.tokenizer.pad_token_id

    def padded(seqs: list[torch.Tensor], value: int) -> torch.Tensor:
        return torch.stack(
            [torch.cat([s.long(), torch.full((width - len(s),), value, dtype=torch.long)]) for s in seqs]
        )

    return Encoded(
        input_ids=padded(rows, pad),
        attention_mask=padded([torch.ones(len(r)) for r in rows], 0),
        loss_mask=padded(masks, 0),
        token_types=padded(types, 0),
        pixel_values=torch.cat(pixels),
    )


def sequence_logps(model: Any, batch: Encoded) -> torch.Tensor:
    """Completion log-probs [B] fp32 of ``batch`` (differentiable in the text model's weights): the tower's
    features once, then the forward with them, as the trainer scores a view."""
    from coati_kto.models.lm_head import model_sequence_logps
    from coati_kto.models.vision import VisionInputs, image_features, vision_keywords

    vision = VisionInputs(pixel_values=batch.pixel_values, token_types=batch.token_types)
    features = image_features(model, vision)
    keywords = vision_keywords(model.config, vision, features)
    return model_sequence_logps(
        model, batch.input_ids, batch.attention_mask, batch.loss_mask, None, vision=keywords
    )


@dataclass
class Scores:
    accuracy: float  # share of held-out images whose colour scores highest
    margin: float  # mean log p(right colour) - max log p(wrong colour), nats
    picked: dict[str, int]  # how often each colour was picked: one colour picked for all = the image ignored
    n: int


def score(logps: torch.Tensor, right: list[int]) -> Scores:
    """Scores of an [N, 4] table of candidate log-probs (columns in COLOURS order) and each row's right column
    (pure: tested on hand-made tables)."""
    names = list(COLOURS)
    best = logps.argmax(dim=1)
    target = torch.tensor(right)
    wrong = logps.clone()
    wrong[torch.arange(len(right)), target] = float("-inf")
    margin = logps[torch.arange(len(right)), target] - wrong.max(dim=1).values
    return Scores(
        accuracy=float((best == target).float().mean()),
        margin=float(margin.mean()),
        picked={name: int((best == i).sum()) for i, name in enumerate(names)},
        n=len(right),
    )


@torch.no_grad()
def candidate_logps(model: Any, processor: Any, images: list[Image.Image]) -> torch.Tensor:
    """[N, 4]: each image's completion log-prob of each colour word (COLOURS order)."""
    names = list(COLOURS)
    rows = []
    for image in images:
        rows.append(sequence_logps(model, encode(processor, [image] * len(names), names)))
    return torch.stack(rows)


def load(model_dir: str | Path) -> tuple[Any, Any]:
    """The model (fp32, eval mode, its tower frozen as training leaves it) and processor of ``model_dir``."""
    from transformers import AutoConfig, AutoProcessor

    from coati_kto.families import auto_model_class
    from coati_kto.models.hf import freeze_vision_tower

    config = AutoConfig.from_pretrained(model_dir)
    model = auto_model_class(config).from_pretrained(model_dir, dtype=torch.float32).eval()
    freeze_vision_tower(model)
    return model, AutoProcessor.from_pretrained(model_dir)


def read_held_out(path: str | Path) -> tuple[list[Image.Image], list[int]]:
    """held_out.jsonl's images (paths relative to the file) and their colours' columns."""
    path = Path(path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    images = [Image.open(path.parent / r["image"]).convert("RGB") for r in rows]
    return images, [list(COLOURS).index(r["colour"]) for r in rows]


def evaluate(model_dir: str | Path, held_out: str | Path) -> Scores:
    """Held-out accuracy of the model in ``model_dir`` (its processor alongside)."""
    model, processor = load(model_dir)
    images, right = read_held_out(held_out)
    return score(candidate_logps(model, processor, images), right)


def table(results: dict[str, Scores]) -> str:
    """A Markdown table, one row per model."""
    lines = [
        "| model | held-out accuracy | margin (nats) | picked " + " / ".join(COLOURS) + " |",
        "| --- | ---: | ---: | --- |",
    ]
    for name, s in results.items():
        picked = " / ".join(str(s.picked[c]) for c in COLOURS)
        lines.append(f"| {name} | {s.accuracy:.1%} | {s.margin:+.2f} | {picked} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--held-out", default="outputs/image_feedback/data/held_out.jsonl")
    parser.add_argument(
        "models", nargs="+", help="NAME=MODEL_DIR, e.g. after=outputs/image_feedback/kto/final"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: a second thread costs more in synchronisation than it saves
    results = {spec.split("=", 1)[0]: evaluate(spec.split("=", 1)[1], args.held_out) for spec in args.models}
    print(table(results))


if __name__ == "__main__":
    main()
