"""What a resume does with a changed config: every change named in one line; the ones that would make the
checkpoint another run's are refused with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.resume import check_resume, config_changes
from coati_kto.errors import ConfigError


def _dump(tmp_path: Path, *overrides: str) -> dict:
    return load_config(write_config(tmp_path, MINIMAL), list(overrides)).model_dump(mode="json")


def test_unchanged_or_quiet_changes_say_nothing(tmp_path: Path) -> None:
    saved = _dump(tmp_path)
    assert check_resume(saved, _dump(tmp_path), "step-6") is None
    assert (
        check_resume(saved, _dump(tmp_path, "train.resume=auto", "logging.tensorboard=false"), "step-6")
        is None
    )


def test_applied_changes_are_listed_in_one_line(tmp_path: Path) -> None:
    saved = _dump(tmp_path, "train.lr=1e-3")
    line = check_resume(
        saved, _dump(tmp_path, "train.lr=5e-4", "kto.beta=0.2", "train.max_steps=20"), "step-6"
    )
    assert line == (
        "resume: 3 setting(s) differ from step-6's config, applied: kto.beta 0.1 -> 0.2, "
        "train.lr 0.001 -> 0.0005, train.max_steps null -> 20"
    )


def test_refused_changes_are_every_one_named_with_the_reason(tmp_path: Path) -> None:
    saved = _dump(tmp_path)
    current = _dump(
        tmp_path, "train.seed=3", "data.max_prompt_length=128", "model.path=other/model", "train.lr=1e-4"
    )
    with pytest.raises(ConfigError) as err:
        check_resume(saved, current, "out/checkpoints/step-6")
    lines = str(err.value).splitlines()
    assert lines == [
        "train.resume out/checkpoints/step-6: data.max_prompt_length 512 -> 128: cannot change on resume (the data "
        "position of the epoch in progress belongs to the old training set)",
        "train.resume out/checkpoints/step-6: model.path some/model -> other/model: cannot change on resume "
        "(the checkpoint's weights belong to another model)",
        "train.resume out/checkpoints/step-6: train.seed 42 -> 3: cannot change on resume (the data order of the "
        "epoch in progress depends on it)",
        "(start a new run in another output.dir, or resume unchanged)",
    ]


def test_an_export_words_the_same_refusals_as_its_own(tmp_path: Path) -> None:
    """coati-kto export refuses the same changes; its lines said "train.resume ...: cannot change on resume (the
    data order of the epoch in progress ...)", of a command that resumes nothing."""
    current = _dump(tmp_path, "train.seed=3", "model.path=other/model", "train.lr=1e-4")
    with pytest.raises(ConfigError) as err:
        check_resume(_dump(tmp_path), current, "step-6", export=True)
    assert str(err.value).splitlines() == [
        "coati-kto export step-6: model.path some/model -> other/model: differs from the config the checkpoint was "
        "trained with",
        "coati-kto export step-6: train.seed 42 -> 3: differs from the config the checkpoint was trained with",
        "(export with the config the run trained with: output.dir/config.yaml)",
    ]


def test_a_max_prompt_length_that_follows_max_length_says_so(tmp_path: Path) -> None:
    """Only data.max_length was changed; data.max_prompt_length (half of it unless set) was refused beside it as
    if the user had changed it too."""
    with pytest.raises(ConfigError) as err:
        check_resume(_dump(tmp_path), _dump(tmp_path, "data.max_length=48"), "step-6")
    assert str(err.value).splitlines()[:2] == [
        "train.resume step-6: data.max_length 1024 -> 48: cannot change on resume (the data position of the epoch "
        "in progress belongs to the old training set)",
        "train.resume step-6: data.max_prompt_length 512 -> 24 (half of data.max_length, its default): cannot "
        "change on resume (the data position of the epoch in progress belongs to the old training set)",
    ]


def test_eval_data_may_change(tmp_path: Path) -> None:
    line = check_resume(_dump(tmp_path), _dump(tmp_path, "data.eval_files=[held.jsonl]"), "step-2")
    assert line is not None and "data.eval_files [] -> [held.jsonl]" in line


def test_changes_are_leaf_keys(tmp_path: Path) -> None:
    changes = config_changes(_dump(tmp_path), _dump(tmp_path, "model.lora={rank: 4}"))
    assert [c.key for c in changes] == ["model.lora"] or all(c.key.startswith("model.lora") for c in changes)


def test_data_keys_that_change_neither_rows_nor_order_may_change(tmp_path: Path) -> None:
    """A prepared_dir copied elsewhere (another machine, a scratch disk), another num_proc or padding-free rows
    build or lay out the same rows in the same order: applied, not refused as "another training set"."""
    line = check_resume(
        _dump(tmp_path),
        _dump(tmp_path, "data.prepared_dir=/scratch/prepared", "data.num_proc=4", "data.padding_free=true"),
        "step-2",
    )
    assert line == (
        "resume: 3 setting(s) differ from step-2's config, applied: data.num_proc 1 -> 4, "
        "data.padding_free false -> true, data.prepared_dir prepared -> /scratch/prepared"
    )


def test_the_tokenizer_spelled_out_as_the_model_path_is_no_change(tmp_path: Path) -> None:
    """model.tokenizer null defaults to model.path: setting it to that same path was refused on resume as
    "another tokenizer"."""
    saved = _dump(tmp_path)
    assert check_resume(saved, _dump(tmp_path, "model.tokenizer=some/model"), "step-2") is None
    assert check_resume(_dump(tmp_path, "model.tokenizer=some/model"), saved, "step-2") is None
    with pytest.raises(ConfigError, match="model.tokenizer null -> other/tokenizer: cannot change"):
        check_resume(saved, _dump(tmp_path, "model.tokenizer=other/tokenizer"), "step-2")


def test_the_same_data_files_written_another_way_are_no_change(tmp_path: Path, monkeypatch) -> None:
    """From a CLI audit: data.train_files written absolute where the run wrote it relative (the same file) was
    refused as another training set, for resume and export; the content is checked by its digest apart."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("{}\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "data.jsonl")
    saved = _dump(tmp_path)  # train_files: data.jsonl, relative
    for spelled in (str(tmp_path / "data.jsonl"), "./data.jsonl", "link.jsonl"):
        assert check_resume(saved, _dump(tmp_path, f"data.train_files=[{spelled}]"), "step-2") is None, (
            spelled
        )
    (tmp_path / "other.jsonl").write_text("{}\n")
    with pytest.raises(
        ConfigError, match=r"data.train_files \[data.jsonl\] -> \[other.jsonl\]: cannot change"
    ):
        check_resume(saved, _dump(tmp_path, "data.train_files=[other.jsonl]"), "step-2")


def _without(config: dict, *keys: str) -> dict:
    """``config`` as a coati-kto without ``keys`` saved it."""
    config = {
        section: dict(values) if isinstance(values, dict) else values for section, values in config.items()
    }
    for key in keys:
        section, leaf = key.split(".")
        del config[section][leaf]
    return config


def test_settings_newer_than_the_checkpoint_count_as_their_default(tmp_path: Path) -> None:
    """A checkpoint from a coati-kto before a setting existed: the key was reported as changed from None on every
    resume (`train.fused_optimizer None -> False`), and a new data key refused the resume as "another training
    set". Unset now, it is no change; set now, it is one from its default (refused under data. as before)."""
    saved = _without(_dump(tmp_path), "train.fused_optimizer", "data.group_by_length", "model.compile")
    assert check_resume(saved, _dump(tmp_path), "step-6") is None
    line = check_resume(saved, _dump(tmp_path, "train.fused_optimizer=true"), "step-6")
    assert (
        line
        == "resume: 1 setting(s) differ from step-6's config, applied: train.fused_optimizer false -> true"
    )
    with pytest.raises(ConfigError, match="data.group_by_length false -> true: cannot change on resume"):
        check_resume(saved, _dump(tmp_path, "data.group_by_length=true"), "step-6")


def test_settings_this_version_no_longer_has_are_not_compared(tmp_path: Path) -> None:
    saved = _dump(tmp_path)
    saved["data"]["bucket_by_domain"] = True  # a data key of an older coati-kto: not "another training set"
    saved["train"]["legacy_knob"] = 3
    assert check_resume(saved, _dump(tmp_path), "step-6") is None


def test_a_section_set_now_is_a_change_not_new_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.lora"):
        check_resume(_dump(tmp_path), _dump(tmp_path, "model.lora={rank: 4}"), "step-6")


def test_train_vision_cannot_change_on_resume(tmp_path: Path) -> None:
    """model.train_vision changes which parameters the optimizer holds; a checkpoint saved before the key existed
    (its default: the tower frozen) resumes unchanged."""
    with pytest.raises(ConfigError) as err:
        check_resume(_dump(tmp_path), _dump(tmp_path, "model.train_vision=true"), "step-6")
    assert str(err.value).splitlines()[0] == (
        "train.resume step-6: model.train_vision false -> true: cannot change on resume (the checkpoint holds "
        "other trainable parameters)"
    )
    saved = _dump(tmp_path)
    del saved["model"]["train_vision"]
    assert check_resume(saved, _dump(tmp_path), "step-6") is None


def test_a_refusal_for_changed_training_data_names_what_changed() -> None:
    """The checkpoint keeps each train file's size and hash, the tokenizer's and the images' (train_data_parts):
    the refusal names the file edited in place; a checkpoint from before keeps the general words."""
    from coati_kto.config.resume import check_training_data

    saved = {"files": [["/d/a.jsonl", 10, "aa"], ["/d/b.jsonl", 20, "bb"]], "tokenizer": "t1", "images": None}
    moved = {"files": [["/e/a.jsonl", 10, "aa"], ["/e/b.jsonl", 21, "bc"]], "tokenizer": "t2", "images": None}
    cases = [
        (saved, moved, "/e/b.jsonl's content, the tokenizer"),
        (saved, {**saved, "files": saved["files"][:1]}, "2 train files -> 1"),
        (None, moved, "the content of data.train_files or the tokenizer"),
    ]
    for old, new, what in cases:
        with pytest.raises(ConfigError) as err:
            check_training_data("1111", "2222", "step-2", (old, new))
        assert str(err.value).splitlines()[0] == (
            f"train.resume step-2: the training data changed since the checkpoint ({what}: 1111 -> 2222): cannot "
            "change on resume (the data position of the epoch in progress belongs to the old training set)"
        )


def test_a_model_folder_written_another_way_is_no_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an audit: `model.path=base/` (or relative, or through a link, or ~/) on the resume of a run given
    `/abs/base` was refused as another model. A folder named two ways is one folder; another folder is refused."""
    (tmp_path / "base").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    saved = _dump(tmp_path, f"model.path={tmp_path / 'base'}", f"model.reference_path={tmp_path / 'base'}")
    for same in ("base", "base/", str(tmp_path / "link"), "~/base"):
        current = _dump(
            tmp_path, f"model.path={same}", f"model.reference_path={same}", f"model.tokenizer={same}"
        )
        assert check_resume(saved, current, "step-6") is None, same
    # model.reference_path given as the folder it defaulted to: the same reference (was "another reference")
    assert (
        check_resume(
            _dump(tmp_path, "model.path=base"),
            _dump(tmp_path, "model.path=base", "model.reference_path=base/"),
            "s",
        )
        is None
    )
    with pytest.raises(ConfigError, match="model.path .* cannot change on resume"):
        check_resume(
            saved, _dump(tmp_path, "model.path=other", f"model.reference_path={tmp_path / 'base'}"), "s"
        )
