"""Evaluation samples without processes: the config keys, the seeded choice and its split over data-parallel
ranks, and the TensorBoard table's round trip (the 2-process runs: tests/distributed/test_eval_samples.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.parallel.distributed import ParallelLayout
from coati_kto.trainer.samples import EvalSamples, Sample, samples_markdown

ROWS = [{"input_ids": [1, 2, 3 + i, 9, 9], "completion_start": 3, "label": i % 2 == 0} for i in range(10)]


def _layout(dp_rank: int, dp_size: int) -> ParallelLayout:
    return ParallelLayout(dp_rank, dp_size, 0, dp_rank, dp_size, None)


def _samples(count: int, seed: int, dp_rank: int = 0, dp_size: int = 1) -> EvalSamples:
    return EvalSamples(ROWS, count, 4, seed, object(), _layout(dp_rank, dp_size), torch.device("cpu"))


def test_off_by_default_and_refused_without_eval_data(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    assert load_config(path).eval.samples == 0
    assert load_config(path, ["eval.samples=4", "data.eval_fraction=0.1"]).eval.samples == 4
    with pytest.raises(ConfigError) as info:
        load_config(path, ["eval.samples=4"])
    assert str(info.value) == (
        "override eval.samples=4: eval.samples 4 needs evaluation data: set data.eval_files or data.eval_fraction, "
        "or eval.samples=0"
    )
    with pytest.raises(ConfigError) as info:  # TRL's KTOConfig name for it
        load_config(path, ["train.generate_during_eval=true"])
    assert (
        str(info.value)
        == "override train.generate_during_eval=true: unknown key; TRL's generate_during_eval true is eval.samples=8 "
        "(8 prompts decoded at each evaluation)"
    )


def test_the_choice_is_seeded() -> None:
    first, again, other = _samples(4, seed=1), _samples(4, seed=1), _samples(4, seed=2)
    assert first.row_ids == again.row_ids and len(set(first.row_ids)) == 4
    assert first.row_ids != other.row_ids
    assert first.prompts == [
        ROWS[i]["input_ids"][:3] for i in first.row_ids
    ]  # the prompt: before the completion
    assert _samples(50, seed=1).places == list(range(10))  # never more than the eval set


def test_each_sample_has_a_prompt_of_its_own() -> None:
    """Paired records (a desirable and an undesirable completion of each of 5 prompts): greedy decoding gives one
    text per prompt, so the samples take 5 distinct prompts at most, never one twice."""
    paired = [
        {"input_ids": [1, 2, 3 + i // 2, 9 + i % 2], "completion_start": 3, "label": i % 2 == 0}
        for i in range(10)
    ]
    for seed in range(20):
        samples = EvalSamples(paired, 4, 4, seed, object(), _layout(0, 1), torch.device("cpu"))
        assert len({tuple(p) for p in samples.prompts}) == 4, (seed, samples.row_ids)
    every = EvalSamples(paired, 50, 4, 0, object(), _layout(0, 1), torch.device("cpu"))
    assert sorted(tuple(p) for p in every.prompts) == [(1, 2, 3 + k) for k in range(5)]


def test_one_question_about_several_images_is_several_prompts() -> None:
    """The image demo asks one question of every image: the samples compared prompt tokens only (the soft image
    tokens are the same for every image), so eval.samples 4 gave one sample."""
    rows = [
        {"input_ids": [1, 2, 5, 9], "completion_start": 3, "label": i % 2 == 0, "images": [bytes([i // 2])]}
        for i in range(8)
    ]
    samples = EvalSamples(rows, 4, 4, 0, object(), _layout(0, 1), torch.device("cpu"))
    assert len(samples.row_ids) == 4 and len({rows[i]["images"][0] for i in samples.row_ids}) == 4
    assert samples.asked == 4


@pytest.mark.parametrize(("count", "dp_size"), [(5, 2), (3, 4), (4, 2), (1, 3)])
def test_the_data_parallel_ranks_share_the_set_and_run_alike(count: int, dp_size: int) -> None:
    """Every place decoded once over the ranks; every rank the same number of rows (its padding marked None),
    so every rank runs the same passes."""
    whole = _samples(count, seed=7)
    ranks = [_samples(count, 7, r, dp_size) for r in range(dp_size)]
    assert {len(s.places) for s in ranks} == {-(-count // dp_size)}
    placed = {p: s.row_ids[k] for s in ranks for k, p in enumerate(s.places) if p is not None}
    assert placed == dict(enumerate(whole.row_ids))


def test_the_table_reads_back_exactly(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from coati_kto.testing.tensorboard import read_samples
    from coati_kto.trainer.logging import MetricWriter

    texts = ["a|b\\c\n<|im_start|>user\nhi &lt; `x` *y* _z_ <br> \\|", "", " lead ", "\n\n"]
    # Every other line boundary of str.splitlines (a decoded "\r" ended the row), and a literal entity.
    texts += ["x\ry\r\nz\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029!", "&#x2028; &#xd;"]
    written = [
        Sample(k, k, k % 2 == 0, text, text + "!", None if k else 0.25) for k, text in enumerate(texts)
    ]
    writer = MetricWriter(True, tmp_path)
    writer.text("eval/samples/policy", samples_markdown(written), 3)
    writer.close()
    # The tag as the docs name it: torch's add_text wrote eval/samples/policy/text_summary.
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert events.Tags()["tensors"] == ["eval/samples/policy"]
    assert events.SummaryMetadata("eval/samples/policy").plugin_data.plugin_name == "text"
    rows = read_samples(tmp_path)["policy"][3]
    assert [(r["prompt"], r["completion"]) for r in rows] == [(t, t + "!") for t in texts]
    assert [(r["sample"], r["label"], r["reward"]) for r in rows][:2] == [
        ("0", "desirable", "0.25"),
        ("1", "undesirable", "n/a"),
    ]
