"""What a run wrote to TensorBoard, read back (tests, benchmarks, the quickstart's check)."""

from __future__ import annotations

import os


def read_scalars(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files in ``log_dir``: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(log_dir: str | os.PathLike[str]) -> dict[str, list[tuple[int, str]]]:
    """Every TEXT entry of the TensorBoard event files in ``log_dir``: {tag: [(step, markdown), ...]}.

    Tags are the writer's (``run/config``), without the ``/text_summary`` suffix the text plugin adds.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
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
        texts[tag.removesuffix("/text_summary")] = values
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
