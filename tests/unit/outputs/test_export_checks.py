"""What ``coati-kto export`` checks before anything loads (``coati_kto.outputs.export``), from a CLI audit: a target
that cannot be written was an OSError traceback (exit 1), an empty ``--out`` was the default target in silence,
and under ``--nproc-per-node N`` a mistake was N error lines or exit 1 with the launcher's rank lines."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coati_kto.errors import UserError
from coati_kto.launch.torchrun import _failure_lines
from coati_kto.outputs.export import check_export, export_target
from coati_kto.runtime.run_dir import COMPLETE, LATEST


def _run(tmp_path: Path) -> Path:
    """output.dir with one complete checkpoint, step-4; returns its checkpoints folder."""
    root = tmp_path / "out" / "checkpoints"
    step = root / "step-4"
    for folder in ("model", "optimizer", "trainer_state"):
        (step / folder).mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 4, "world_size": 1}')
    torch.save({}, step / "trainer_state" / "rank-0.pt")  # damage() reads the zip directory only
    torch.save({}, step / "lr_scheduler.pt")
    (step / COMPLETE).write_text("4\n")
    (root / LATEST).write_text("step-4")
    return root


def test_a_target_that_cannot_be_written_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _run(tmp_path)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(UserError, match=r"^coati-kto export: cannot write .*a_file/x \(File exists\)$"):
        export_target(root, "auto", str(tmp_path / "a_file" / "x"))
    # a read-only mount: mkdir of an existing parent passes; access() answers EROFS
    monkeypatch.setattr("os.access", lambda path, mode: False)
    target = tmp_path / "ro" / "x"
    with pytest.raises(UserError) as err:
        export_target(root, "auto", str(target))
    assert str(err.value) == f"coati-kto export: cannot write {target} (its folder {target.parent} is not writable)"


def test_the_launcher_checks_the_export_once_before_its_ranks(tmp_path: Path) -> None:
    root = _run(tmp_path)
    output = SimpleNamespace(dir=str(root.parent), export_dtype="model")
    plugin = SimpleNamespace(precision="fp32")
    (root.parent / "exports" / "step-4").mkdir(parents=True)
    with pytest.raises(UserError, match="exports/step-4 exists; remove it or name another with --out"):
        check_export(output, None, plugin, ("auto", None, False), 1)
    with pytest.raises(UserError, match="step-9 is not a complete checkpoint"):
        check_export(output, None, plugin, (str(root / "step-9"), None, False), 1)
    check_export(output, None, plugin, ("auto", str(tmp_path / "elsewhere"), False), 1)  # fine: no error


def test_a_rank_s_mistake_is_exit_2_when_torchrun_ended_the_others() -> None:
    """An export's other ranks end 143 under torchrun's SIGTERM (STOP.quit_on_stop): that was "rank 1 failed",
    exit 1; the mistake's 2 wins, its one line already printed by the rank that found it."""
    failures = {
        r: SimpleNamespace(exitcode=c, local_rank=r, signal_name=lambda: "SIGTERM")
        for r, c in enumerate((2, 128 + signal.SIGTERM, -signal.SIGTERM))
    }
    assert _failure_lines(SimpleNamespace(failures=failures)) == ([], 2)


def test_an_empty_out_is_refused() -> None:
    from coati_kto.cli_args import check_numbers

    with pytest.raises(UserError, match=r"^--out needs a directory, got ''$"):
        check_numbers(SimpleNamespace(out=""))


def test_the_launcher_checks_fp32_masters_against_its_own_process_count(tmp_path: Path) -> None:
    """From the review of the launcher's check: it read WORLD_SIZE, unset in the launcher, so every 2-process bf16
    checkpoint's fp32 export under --nproc-per-node 2 was refused ("run it with --nproc-per-node 2")."""
    root = _run(tmp_path)
    (root / "step-4" / "meta.json").write_text('{"step": 4, "world_size": 2}')
    torch.save({}, root / "step-4" / "trainer_state" / "rank-1.pt")
    output = SimpleNamespace(dir=str(root.parent), export_dtype="fp32")
    plugin = SimpleNamespace(precision="bf16", tp_size=1, sp_size=1, pp_size=1)
    check_export(output, None, plugin, ("auto", str(tmp_path / "x"), False), 2)  # its layout: fine
    with pytest.raises(UserError, match="run it with --nproc-per-node 2"):
        check_export(output, None, plugin, ("auto", str(tmp_path / "x"), False), 1)
