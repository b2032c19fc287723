"""`train` on bad input says what `prepare` says: one ``error:`` line, exit 2, on 1 and 2 processes.

`coati-kto train` on a record defect used to print ``TypeError: RecordError.__init__() missing 3 required
positional arguments`` on every rank: ``on_rank0`` rebuilt rank 0's error as ``type(err)(message)``. Every
bad-input case the `prepare` tests cover (tests/unit/data) is built here once; `coati-kto prepare` gives the
expected line, and `train` must print exactly it, once, from rank 0 (the other rank prints nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import datasets
import pytest
import yaml
from helpers import env

from coati_kto.testing.distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "data"))
from test_data_formats import BAD  # noqa: E402 - the record defects the prepare tests cover

GOOD = {"prompt": "a", "completion": "b", "label": True}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _chat(i: int, label: bool) -> dict:
    user = {"role": "user", "content": f"Please add {i} and 3."}
    reply = {"role": "assistant", "content": "The answer is 5." if label else "I cannot help with that."}
    return {"messages": [user, reply], "label": label}


def _data_cases(root: Path) -> dict[str, list]:
    """name -> data.train_files: each a defect a prepare test covers (test_data_formats, test_record_checks,
    test_prepare), plus the issue's label "maybe"."""
    cases = {
        f"record_{i}_{reason}": [str(_jsonl(root / f"bad{i}.jsonl", [GOOD, GOOD, row]))]
        for i, (row, _, reason) in enumerate(BAD)
    }
    cases["label_maybe"] = [str(_jsonl(root / "maybe.jsonl", [GOOD] * 40 + [{**GOOD, "label": "maybe"}]))]
    good = json.dumps(GOOD).encode()
    (root / "latin1.jsonl").write_bytes(good + b"\n" + good[:-1] + b"\xff}\n")
    cases["not_utf8"] = [str(root / "latin1.jsonl")]
    (root / "broken.parquet").write_bytes(b"PAR1 nonsense")
    cases["broken_parquet"] = [str(root / "broken.parquet")]
    nan = {"prompt": ["a"] * 3, "completion": ["b"] * 3, "label": [1.0, float("nan"), 0.0]}
    datasets.Dataset.from_dict(nan).to_parquet(str(root / "gap.parquet"))
    cases["nan_label_parquet"] = [str(root / "gap.parquet")]
    cases["lone_surrogate"] = [
        str(
            _jsonl(
                root / "surrogate.jsonl", [GOOD, '{"prompt": "x \\ud800", "completion": "b", "label": false}']
            )
        )
    ]
    classes = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "completion": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["good", "bad"]),
        }
    )
    datasets.Dataset.from_list([{**GOOD, "label": -1}], features=classes).save_to_disk(str(root / "classgap"))
    cases["class_label_missing"] = [str(root / "classgap")]
    classes["label"] = datasets.ClassLabel(names=["x", "y"])
    datasets.Dataset.from_list([{**GOOD, "label": 0}] * 2, features=classes).save_to_disk(str(root / "xy"))
    cases["class_label_unnamed"] = [str(root / "xy")]
    lines = json.dumps([GOOD] * 3, indent=2).splitlines()
    lines[4] = lines[4].replace('"label"', "label")
    (root / "pretty.json").write_text("\n".join(lines))
    cases["broken_pretty_json"] = [str(root / "pretty.json")]
    cases["missing_file"] = [str(root / "missing.jsonl")]
    (root / "dir").mkdir()
    _jsonl(root / "dir" / "a.jsonl", [GOOD])
    (root / "dir" / "d.csv").write_text("x")
    cases["unread_file_in_directory"] = [str(root / "dir")]
    cases["single_label"] = [str(_jsonl(root / "single.jsonl", [_chat(i, True) for i in range(8)]))]
    empty = [*(_chat(i, i % 2 == 0) for i in range(6)), {"prompt": "", "completion": " yes", "label": True}]
    cases["empty_prompt"] = [str(_jsonl(root / "empty.jsonl", empty))]
    return cases


def _write_cases(root: Path, model_dir: Path) -> list[str]:
    """Every case's config file (its own output.dir and data.prepared_dir)."""
    good = str(_jsonl(root / "good.jsonl", [_chat(i, i % 2 == 0) for i in range(8)]))
    configs = [(name, model_dir, files, {}) for name, files in _data_cases(root).items()]
    small_vocab = root / "small_vocab"  # tokens the model cannot embed
    shutil.copytree(model_dir, small_vocab)
    config = json.loads((model_dir / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    configs.append(("token_ids_past_vocabulary", small_vocab, [good], {}))
    short = root / "short_positions"  # rows past a GPT-2 style learned position table
    shutil.copytree(model_dir, short)
    from transformers import GPT2Config

    GPT2Config(n_positions=8, vocab_size=1000, bos_token_id=0, eos_token_id=0).save_pretrained(short)
    configs.append(("rows_past_positions", short, [good], {}))
    (root / "a_file").write_text("not a directory")
    configs.append(("prepared_dir_is_a_file", model_dir, [good], {"prepared_dir": str(root / "a_file")}))
    paths = []
    for name, model, files, data in configs:
        cfg = {
            "model": {"path": str(model)},
            "data": {"train_files": files, "prepared_dir": str(root / name / "prepared"), **data},
            "train": {"micro_batch_size": 2, "max_steps": 1},
            "plugin": {"name": "ddp", "precision": "fp32", "zero_stage": 0},
            "output": {"dir": str(root / name / "out")},
        }
        paths.append(root / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(cfg))
    return [str(p) for p in paths]


@contextlib.contextmanager
def _stderr_of_process() -> Iterator[list[str]]:
    """Everything written to this process's stderr (fd 2: prints, warnings, loggers' handlers) while open."""
    sys.stderr.flush()
    saved, box = os.dup(2), []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            box.append(tmp.read().decode())


def _each(commands: list[str], configs: list[str]) -> list[list[tuple[int, str]]]:
    """Per config, per command: the exit code and stderr of the CLI's own path (``cli._main``, as ``main`` calls
    it, minus closing the process group: the next case reuses it)."""
    from coati_kto.cli import _main
    from coati_kto.cli_args import parse as _parse

    out = []
    for config in configs:
        out.append([])
        for command in commands:
            with _stderr_of_process() as printed:
                code = _main(_parse([command, config]), os.environ.get("RANK"))
            out[-1].append((code, printed[0]))
    return out


@pytest.fixture(scope="module")
def configs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> config file, one per bad-input case."""
    return {Path(c).stem: c for c in _write_cases(tmp_path_factory.mktemp("bad_inputs"), tiny_model_dir)}


@pytest.fixture(scope="module")
def one_process(configs: dict[str, str]) -> dict[str, list[tuple[int, str]]]:
    """name -> [prepare's (exit code, stderr), train's], on one process."""
    (results,) = run_distributed(_each, 1, ["prepare", "train"], list(configs.values()))
    return dict(zip(configs, results, strict=True))


def test_train_on_one_process_prints_prepares_line(one_process: dict[str, list[tuple[int, str]]]) -> None:
    assert len(one_process) == len(BAD) + 15
    for name, (prepared, trained) in one_process.items():
        assert prepared[0] == 2 and prepared[1].startswith("error: ") and prepared[1].count("\n") == 1, name
        assert trained == prepared, name
    # The lines are the defects' own, file:line and field, as tests/unit/data asserts them (TRL's vision format
    # among them).
    for i, (_, expected, reason) in enumerate(BAD):
        line = one_process[f"record_{i}_{reason}"][1][1]
        assert ":3: " in line and expected in line, line
    assert one_process["label_maybe"][1][1].endswith(
        "maybe.jsonl:41: field 'label': expected true/false or 0/1 (1.0/0.0), got \"maybe\"\n"
    )


def test_train_on_two_processes_prints_it_once(
    configs: dict[str, str], one_process: dict[str, list[tuple[int, str]]]
) -> None:
    rank0, rank1 = run_distributed(_each, 2, ["train"], list(configs.values()))
    assert rank0 == [[prepared] for prepared, _ in one_process.values()]
    assert rank1 == [[(2, "")]] * len(configs)  # the same error on every rank: rank 0 prints it


def test_the_launcher_prints_one_line_and_exits_2(
    configs: dict[str, str], one_process: dict[str, list[tuple[int, str]]]
) -> None:
    config, (_, line) = configs["label_maybe"], one_process["label_maybe"][0]
    cmd = [sys.executable, "-m", "coati_kto", "train", "--nproc-per-node", "2", config]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert (proc.returncode, proc.stderr) == (2, line), proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
