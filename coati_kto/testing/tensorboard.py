"""What a run wrote to TensorBoard, read back (tests, benchmarks, the quickstart's check)."""

from __future__ import annotations

import os
from typing import Any


def read_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files in ``log_dir``: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, str]]]:
    """Every TEXT entry of the TensorBoard event files in ``log_dir``: {tag: [(step, markdown), ...]}.

    Tags as written (``run/config``; torch's ``add_text`` would have added ``/text_summary``, the trainer's writer
    does not). Read as TensorBoard's server reads them (its plugin accumulator), which drops the text a resumed
    run's purge covers; the older ``event_accumulator`` purges only scalars, images and histograms.
    """
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            continue
        values = [
            (e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode()) for e in acc.Tensors(tag)
        ]
        texts[tag] = values
    return texts


def read_hparams(log_dir: str | os.PathLike[str]) -> dict[str, float | str | bool]:
    """The hyperparameters a run wrote for TensorBoard's HPARAMS tab (its session-start summary)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    found: dict[str, float | str | bool] = {}
    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for name, value in data.session_start_info.hparams.items():
                found[name] = getattr(value, value.WhichOneof("kind"))
    return found


def read_samples(log_dir: str | os.PathLike[str]) -> dict[str, dict[int, list[dict[str, str]]]]:
    """The evaluation samples a run wrote (``eval.samples``): {"policy" | "reference": {step: [row, ...]}}, each
    row {"sample", "label", "reward", "prompt", "completion"} as text, prompt and completion unescaped."""
    from coati_kto.trainer.samples import COLUMNS, unescape

    found: dict[str, dict[int, list[dict[str, str]]]] = {}
    for tag, entries in read_texts(log_dir).items():
        if not tag.startswith("eval/samples/"):
            continue
        for step, markdown in entries:
            rows = []
            for line in markdown.splitlines()[2:]:  # past the header and its rule
                cells = [cell[1:-1] for cell in _cells(line[1:-1])]  # each written as "| " + text + " "
                rows.append({c: unescape(v) for c, v in zip(COLUMNS, cells, strict=True)})
            found.setdefault(tag.removeprefix("eval/samples/"), {})[step] = rows
    return found


def _cells(inner: str) -> list[str]:
    """A markdown table row's cells: split at ``|`` not escaped by a backslash."""
    cells, current, k = [], [], 0
    while k < len(inner):
        if inner[k] == "\\" and k + 1 < len(inner):
            current.append(inner[k : k + 2])
            k += 2
            continue
        if inner[k] == "|":
            cells.append("".join(current))
            current = []
        else:
            current.append(inner[k])
        k += 1
    cells.append("".join(current))
    return cells


def read_images(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, Any]]]:
    """Every image of the TensorBoard event files in ``log_dir``: {tag: [(step, HWC uint8 array), ...]}, decoded
    from the PNG TensorBoard stores."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0})
    acc.Reload()
    return {
        tag: [
            (e.step, np.asarray(Image.open(io.BytesIO(e.encoded_image_string)).convert("RGB")))
            for e in acc.Images(tag)
        ]
        for tag in acc.Tags()["images"]
    }
