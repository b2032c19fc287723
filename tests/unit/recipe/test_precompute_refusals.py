"""``coati-kto precompute`` with a user mistake says that mistake and nothing else. With the online reference it
printed its note first ("note: kto.reference is online: ..."), before a missing data file or a malformed record;
a missing model.reference_path was found only after prepare (hours on a large set) and the note."""

from __future__ import annotations

import json
from pathlib import Path

from coati_kto.testing.cli import run_cli

NOTE = (
    "note: kto.reference is online: train scores the reference as it goes and does not read this cache; "
    "train with kto.reference=cached to use it"
)


def _config(tmp_path: Path, model: Path) -> Path:
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(8):
            answer = "Paris is the capital." if i % 2 else "I cannot help with that."
            f.write(
                json.dumps({"prompt": f"Question {i}?", "completion": answer, "label": bool(i % 2)}) + "\n"
            )
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"model: {{path: {model}}}\n"
        f"data: {{train_files: [{data}], prepared_dir: {tmp_path / 'prepared'}, max_length: 64}}\n"
        "plugin: {name: ddp, precision: fp32}\n"
        "kto: {reference: online}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\n"
    )
    return config


def test_a_user_mistake_is_precomputes_only_output_and_the_note_precedes_the_scoring(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = _config(tmp_path, tiny_model_dir)
    missing, no_model = tmp_path / "missing.jsonl", tmp_path / "no-model"
    # every problem of the paths at once, before anything else
    both = run_cli(
        ["precompute", config, f"data.train_files=[{missing}]", f"model.reference_path={no_model}"]
    )
    assert (both.returncode, both.stdout) == (2, ""), both.stdout + both.stderr[-2000:]
    assert both.stderr.splitlines() == [
        f"error: data.train_files: {missing}: no such file or directory",
        f"model.reference_path: {no_model} does not exist (a local path; a hub id looks like org/name)",
    ]
    # a malformed record, found by prepare's reading: the one line too
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"\n')
    record = run_cli(["precompute", config, f"data.train_files=[{bad}]"])
    assert (record.returncode, record.stdout) == (2, ""), record.stdout + record.stderr[-2000:]
    assert record.stderr.splitlines() == [
        f"error: {bad}:1: malformed JSON (Expecting ',' delimiter at column 15)"
    ]
    assert not (tmp_path / "prepared").exists()
    # no mistake: the note still comes before the scoring (after prepare's summary: the data is read first)
    done = run_cli(["precompute", config])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    at = lines.index(NOTE)
    assert lines[0].startswith(f"prepared {tmp_path / 'prepared'} ") and at > 0
    assert lines[at + 1].startswith("reference log-probs: computing 8 examples") and len(lines) == at + 2
