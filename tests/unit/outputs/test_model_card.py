"""The model card travels alone (uploaded with final/): it embeds the config and says what the run chose."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.outputs.model_card import render


def test_card_embeds_the_config_and_the_run_notes(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, MINIMAL), ["train.lr=5e-4"])
    notes = ["resume: 1 setting(s) differ from step-6's config, applied: train.lr 0.001 -> 0.0005"]
    card = render(config, None, None, 12, (0.5, 1.0), 2, notes)
    assert "../config.yaml" not in card  # a link that dangles once final/ is uploaded on its own
    assert f"- {notes[0]}" in card
    embedded = card.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(embedded) == config.model_dump(mode="json")


def test_card_multiplies_the_batch_over_data_parallel_ranks_only(tmp_path: Path) -> None:
    """tp 2 on 2 processes is one data-parallel rank: the card said "x 2 process(es)", twice the real batch."""
    config = load_config(write_config(tmp_path, MINIMAL), ["plugin.tp_size=2", "train.accumulation_steps=3"])
    card = render(config, None, None, 12, (1.0, 1.0), 2, [])
    m = config.train.micro_batch_size
    assert (
        f"micro-batch {m} x accumulation 3 x 1 data-parallel rank(s) = {3 * m} examples per step, on 2"
        in card
    )


def test_export_note_says_what_final_holds(tmp_path: Path) -> None:
    """final/ was written in bf16 after bf16 training from an fp32 base without a word (issue 17)."""
    from coati_kto.outputs.weights import export_note

    bf16 = ["plugin.precision=bf16", "plugin.zero_stage=2"]
    config = load_config(write_config(tmp_path, MINIMAL), bf16)
    assert export_note(config.plugin.precision, config.training_output().export_dtype) == (
        "final/ holds the bf16 weights the run trained (its base was loaded in fp32 and cast); "
        "output.export_dtype=fp32 writes the fp32 master weights instead"
    )
    fp32 = load_config(write_config(tmp_path, MINIMAL), [*bf16, "output.export_dtype=fp32"])
    assert "fp32 master weights (trained in bf16" in export_note(
        fp32.plugin.precision, fp32.output.export_dtype
    )


def _held_out_run(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """A config with data.eval_fraction 0.2, and its data stats: 32 training examples, 8 held out."""
    config = load_config(write_config(tmp_path, MINIMAL), ["data.eval_fraction=0.2"])
    split = {"examples": 8, "labels": {"desirable": 6, "undesirable": 2}}
    stats = {
        "train": {**split, "examples": 32},
        "eval": split,
        "files": {"train": ["data.jsonl"], "eval": []},
    }
    return config, stats


def test_card_of_a_held_out_split_and_of_a_resume_after_the_last_evaluation(tmp_path: Path) -> None:
    """With data.eval_fraction the card listed "eval files: " (nothing); and `train.resume=auto` over a finished
    run (single_gpu.yaml's default) rewrote final/README.md saying no evaluation set was configured."""
    config, stats = _held_out_run(tmp_path)
    card = render(config, stats, None, 12, (1.0, 1.0), 1).splitlines()
    assert "- eval files: held out of the train files by prompt (data.eval_fraction 0.2)" in card
    assert "No evaluation set was configured (data.eval_files / data.eval_fraction)." not in card
    assert (
        "No evaluation ran in the process that wrote this card (a resume or `coati-kto export` after the "
        "last one, or evaluation turned off): see TensorBoard's eval/ scalars for any earlier ones." in card
    )
    no_eval = render(config, {**stats, "eval": None}, None, 12, (1.0, 1.0), 1).splitlines()
    assert "No evaluation set was configured (data.eval_files / data.eval_fraction)." in no_eval


def test_tensorboard_data_text_names_a_held_out_eval_split() -> None:
    """With data.eval_fraction the eval split has no files of its own: TensorBoard's run/data text showed an empty
    "eval files:" line."""
    from coati_kto.trainer.run_summary import data_stats_markdown

    split = {"examples": 4, "labels": {"desirable": 2, "undesirable": 2}, "truncated": {}, "dropped": {}}
    stats = {"files": {"train": ["t.jsonl"], "eval": []}, "train": split, "eval": split}
    lines = data_stats_markdown(stats).splitlines()
    assert "**train files:** `t.jsonl`" in lines
    assert "**eval files:** held out of the train files (data.eval_fraction)" in lines


def test_the_data_table_counts_kl_rows_cut() -> None:
    """TensorBoard's run/data text and the card listed truncated prompts and completions but not the KL rows cut
    to fit (an sp run's card: 10 prompts truncated, the 11 KL prompts cut not shown), under a "dropped (too long)"
    heading also used for what truncate drops."""
    from coati_kto.trainer.run_summary import data_stats_table

    truncated = {"prompt": 10, "completion": 2, "kl_prompt": 11, "kl_completion": 3}
    split = {"examples": 40, "labels": {"desirable": 30, "undesirable": 10}, "truncated": truncated}
    stats = {"files": {"train": ["t.jsonl"]}, "train": {**split, "dropped": {"no_room_for_completion": 1}}}
    lines = data_stats_table(stats).splitlines()
    assert lines[0].endswith("| KL rows cut (prompts / completions) | dropped to fit |")
    assert lines[2] == "| train | 40 | 30 | 10 | 10 | 2 | 11 / 3 | 1 |"


def test_card_says_how_completions_end(tmp_path: Path) -> None:
    """Issue 32: prepare's one line on where completions end (the template's end of turn, or EOS) is on the card."""
    config = load_config(write_config(tmp_path, MINIMAL))
    split = {"examples": 8, "labels": {"desirable": 6, "undesirable": 2}}
    line = "completions end with the template's `<end_of_turn>`; no EOS added"
    stats = {"train": split, "eval": None, "files": {"train": ["data.jsonl"]}, "completion_end": line}
    assert f"Completions: {line}." in render(config, stats, None, 12, (1.0, 1.0), 1).splitlines()


def test_the_card_is_on_disk_before_the_export_counts_as_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """final/'s weights were synced, then README.md (the card, whose presence marks final/ finished for
    ``export --push``) was written with a plain write_text: a node crash could leave it empty or lost. Now its
    bytes are synced, then its directory's entries, before save_final returns."""
    from coati_kto.recipe import save

    config = load_config(write_config(tmp_path, MINIMAL))
    final = tmp_path / "out" / "final"

    def weights(*args: object) -> Path:  # write_weights: final/ complete and synced (runtime.durable)
        final.mkdir(parents=True)
        (final / "model.safetensors").write_text("weights")
        return final

    monkeypatch.setattr(save, "write_weights", weights)
    monkeypatch.setattr(save, "render", lambda *args: "# the card\n")
    synced: list[tuple[int, int]] = []  # (inode, size) of each fsync'd file or directory, in order
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append((os.fstat(fd).st_ino, os.fstat(fd).st_size))

    monkeypatch.setattr(os, "fsync", fsync)
    layout = SimpleNamespace(is_main=True, world_size=1)
    run = SimpleNamespace(layout=layout, notes=[], data=SimpleNamespace(stats=None), weights=(1.0, 1.0))
    run.out_dir, run.tokenizer = tmp_path / "out", None
    save.save_final(config, run, SimpleNamespace(history=[], global_step=3), {})
    card = final / "README.md"
    assert card.read_text() == "# the card\n"
    inodes = [inode for inode, _ in synced]
    assert (card.stat().st_ino, card.stat().st_size) in synced  # its whole bytes
    assert final.stat().st_ino in inodes[inodes.index(card.stat().st_ino) :]  # then its directory entry


def test_card_states_plainly_that_completions_end_with_no_eos(tmp_path: Path) -> None:
    """With no EOS anywhere the card read "Completions: warning: completions end as given: ...; give the tokenizer
    an eos_token ...": prepare's command-line warning, pasted with its prefix and its fix. It now says what the
    model is, and keeps any other ending that follows."""
    from coati_kto.data.endings import completion_end_line

    config = load_config(write_config(tmp_path, MINIMAL))
    split = {"examples": 8, "labels": {"desirable": 6, "undesirable": 2}}
    stats = {"train": split, "eval": None, "files": {"train": ["data.jsonl"]}}
    no_eos = (
        "Completions end with no end-of-sequence token: neither the tokenizer nor model.path's "
        "generation_config.json or config.json gives an EOS token in the tokenizer's vocabulary, so the model is "
        "never trained to stop"
    )
    for counts, rest in (
        ({"as_given:plain": 8}, ""),
        (
            {"as_given:plain": 3, "stop:<|im_end|>": 5},
            "; completions end with the template's `<|im_end|>`; no EOS added",
        ),
    ):
        line = completion_end_line([counts], None)  # stats.json's completion_end, as prepare writes it
        card = render(config, {**stats, "completion_end": line}, None, 12, (1.0, 1.0), 1)
        assert f"{no_eos}{rest}." in card.splitlines()
        assert "warning:" not in card and "give the tokenizer an eos_token" not in card


def test_a_non_finite_last_evaluation_is_said_not_hidden(tmp_path: Path) -> None:
    """From an evaluation audit: a non-finite evaluation's record holds no eval/loss, so the card skipped it. It
    showed an earlier finite evaluation as the run's, or, with every evaluation non-finite, said none had run."""
    import math

    from coati_kto.outputs.model_card import last_eval
    from coati_kto.trainer.metrics import SUM_KEYS, evaluated

    totals = dict.fromkeys(SUM_KEYS, 0.0) | {
        "loss": 3.5,
        "examples": 8.0,
        "count/chosen": 6.0,
        "count/rejected": 2.0,
    }
    finite = {
        "step": 2,
        **{f"eval/{k}": v for k, v in evaluated(totals, {"kl": 0.0, "kl_raw": 0.0}, 1.0).items()},
    }
    bad = {**totals, "loss": math.nan, "nonfinite": 1.0, "nonfinite_examples": 7.0}
    poisoned = evaluated(bad, {"kl": math.nan, "kl_raw": math.nan}, 1.0)
    history = [
        finite,
        {"step": 4, "train/loss": 0.5},
        {"step": 6, **{f"eval/{k}": v for k, v in poisoned.items()}},
    ]
    record = last_eval(history)
    assert record is not None and record["step"] == 6 and "eval/loss" not in record
    config, stats = _held_out_run(tmp_path)
    card = render(config, stats, record, 12, (1.0, 1.0), 1).splitlines()
    assert (
        "The last evaluation, at optimizer step 6, was non-finite (NaN/inf) in 7 of its examples: no means were "
        "taken (`eval/nonfinite_examples`; the run's log names the values). See TensorBoard's eval/ scalars for "
        "the evaluations before it." in card
    )
    assert not any("at optimizer step 2" in line for line in card)


def test_a_card_that_cannot_be_written_leaves_no_final_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a failure-injection audit: the disk filling after the weights left final/ (or exports/step-N) without
    its card, with a traceback; a rerun of the export then refused the folder as existing."""
    import errno

    from coati_kto.recipe import save
    from coati_kto.trainer.checkpoint import CheckpointSaveError

    final = tmp_path / "final"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"weights")

    def full(directory: Path, card: str) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "README.md"))

    monkeypatch.setattr(save, "write_card", full)
    with pytest.raises(CheckpointSaveError) as err:
        save.card_or_nothing(final, "# card", "export it again")
    assert str(err.value) == (
        f"the model card could not be written to {final} (No space left on device: {final / 'README.md'}): "
        "removed final/; export it again"
    )
    assert not final.exists()
