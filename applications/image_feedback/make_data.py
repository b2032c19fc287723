"""Synthetic image feedback: "What colour is this image?" over 4 colours, unpaired and imbalanced.

Each image is 32x32 pixels: a base colour, shifted as a whole by a uniform shade offset in [-40, 40] per channel,
plus Gaussian noise (std 25) per pixel, clipped to 0-255. A training record asks about one image and answers
with a colour word:
* desirable (label true): the image's colour;
* undesirable (label false): one of the three other colours, drawn at random.

The feedback is imbalanced the other way round from the quickstart: more undesirable rows than desirable ones
(``N_DESIRABLE`` : ``N_UNDESIRABLE``), and no image has both a desirable and an undesirable row (unpaired).
The held-out images come from another seed (``HELD_OUT_PER_COLOUR`` per colour) and appear in no training
record; eval.jsonl holds feedback on them for the trainer's evaluation (TensorBoard's eval/ scalars).

Records are TRL's conversational format with images: ``images`` holds the PNG paths relative to the JSONL file
(the PNGs are written next to it, in ``images/``), and the user turn's ``{"type": "image"}`` part marks where
the image goes.
"""

from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (210, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (220, 200, 40),
}
QUESTION = "What colour is this image?"
SIZE = 32  # pixels; the tiny Gemma 3 processor resizes to 28
SHADE = 40  # uniform offset of the whole image, per channel
NOISE = 25.0  # Gaussian std per pixel and channel
N_DESIRABLE = 240
N_UNDESIRABLE = 400  # 3:5, more undesirable than desirable
HELD_OUT_PER_COLOUR = 10
HELD_OUT_SEED_OFFSET = 1_000_003  # held-out images: another generator, never a training image


def draw_image(colour: str, rng: np.random.Generator) -> Image.Image:
    """One ``SIZE`` x ``SIZE`` RGB image of ``colour``: its base, a shade offset for the whole image, noise."""
    base = np.array(COLOURS[colour], dtype=np.float64)
    shade = rng.uniform(-SHADE, SHADE, size=3)
    pixels = base + shade + rng.normal(0.0, NOISE, size=(SIZE, SIZE, 3))
    return Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), "RGB")


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def prompt() -> list[dict]:
    """The user turn: the question, then the image (next to the answer: the tiny model's first layer attends
    within a sliding window)."""
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]


def record(image: str, answer: str, label: bool) -> dict:
    """One TRL-format unpaired record: a conversational prompt with one image, a one-word completion."""
    return {
        "prompt": prompt(),
        "completion": [{"role": "assistant", "content": answer}],
        "label": label,
        "images": [image],
    }


def make_data(seed: int = 0) -> dict[str, list]:
    """The pure function of ``seed`` behind :func:`write_data`: {"train": [(image, record)],
    "held_out": [(image, colour)], "eval": [record]}, each image a PIL image and a record's ``images[0]`` its
    file name; the eval records ask about the held-out images in order."""
    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    names = list(COLOURS)
    # Every colour equally often within each label; the rows shuffled so that no order leaks the label.
    rows = [(names[i % 4], True) for i in range(N_DESIRABLE)]
    rows += [(names[i % 4], False) for i in range(N_UNDESIRABLE)]
    pick.shuffle(rows)
    train = []
    for i, (colour, label) in enumerate(rows):
        answer = colour if label else pick.choice([c for c in names if c != colour])
        name = f"images/train_{i:04d}.png"
        train.append((draw_image(colour, rng), record(name, answer, label)))
    held = np.random.default_rng(seed + HELD_OUT_SEED_OFFSET)
    held_out = [(draw_image(colour, held), colour) for _ in range(HELD_OUT_PER_COLOUR) for colour in names]
    # The held-out images as feedback too (the trainer's eval/ scalars): half desirable, half a wrong colour.
    eval_records = []
    for i, (_, colour) in enumerate(held_out):
        answer = colour if i % 2 == 0 else pick.choice([c for c in names if c != colour])
        eval_records.append(record(f"images/held_out_{i:03d}.png", answer, i % 2 == 0))
    return {"train": train, "held_out": held_out, "eval": eval_records}


def write_data(out: Path, seed: int = 0) -> dict[str, Path]:
    """Write ``out``/train.jsonl, ``out``/held_out.jsonl ({"image": path, "colour": name}), ``out``/eval.jsonl
    (feedback on the held-out images) and the PNGs in ``out``/images/; returns the three JSONL paths."""
    data = make_data(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    for image, rec in data["train"]:
        (out / rec["images"][0]).write_bytes(png_bytes(image))
    held_rows = []
    for i, (image, colour) in enumerate(data["held_out"]):
        name = f"images/held_out_{i:03d}.png"
        (out / name).write_bytes(png_bytes(image))
        held_rows.append({"image": name, "colour": colour})
    paths = {"train": out / "train.jsonl", "held_out": out / "held_out.jsonl", "eval": out / "eval.jsonl"}
    paths["train"].write_text("".join(json.dumps(r) + "\n" for _, r in data["train"]))
    paths["eval"].write_text("".join(json.dumps(r) + "\n" for r in data["eval"]))
    paths["held_out"].write_text("".join(json.dumps(r) + "\n" for r in held_rows))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/image_feedback/data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_data(args.out, args.seed)
    print(f"{N_DESIRABLE} desirable : {N_UNDESIRABLE} undesirable -> {paths['train']}")
    print(f"{HELD_OUT_PER_COLOUR * len(COLOURS)} held-out images -> {paths['held_out']}")


if __name__ == "__main__":
    main()
