"""The advice that ends a line about another rank's failure is the running command's (``parallel/advice.py``).

Before: every such line ended with "resume with train.resume=auto", also under ``coati-kto precompute`` and
``coati-kto export``, which have nothing to resume (the user re-runs them). train's wording is unchanged.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import coati_kto.parallel.advice as advice
import coati_kto.parallel.store_waits as store_waits
from coati_kto.parallel.distributed import peer_failure
from coati_kto.runtime.watchdog import Heartbeat

PRECOMPUTE = "run coati-kto precompute again (it reuses the prepared data and any complete reference cache)"
EXPORT = "run coati-kto export again"
TRAIN = "resume with train.resume=auto"
CLOSED = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4810")


class _Silent:
    """A store where nothing is ready and nobody failed."""

    def check(self, keys: list[str]) -> bool:
        return False


def _lines(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each kind of line, under the command set now: a peer's failure in a store wait, a store wait's timeout,
    a collective's failure, the watchdog's lost peer."""
    timed_out = []
    monkeypatch.setattr(store_waits, "_timeout_s", 0.0)
    with pytest.raises(store_waits.FileWaitTimeoutError) as raised:
        store_waits._poll(lambda: False, "global rank 0 to write final/", _Silent())
    timed_out.append(str(raised.value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setattr(os, "_exit", lambda code: timed_out.append(f"exit {code}"))
    Heartbeat(1, 2, timeout=10.0)._fail("rank 0 stopped responding 12 s ago (its process or node is gone)")
    watchdog = capsys.readouterr().err.strip()
    peer = store_waits.peer_failed("rank 0: OSError: disk full", "global rank 0 to prepare the data")
    return [str(peer), timed_out[0], peer_failure(CLOSED) or "", watchdog, timed_out[1]]


@pytest.mark.parametrize(
    "command, advised", [("precompute", PRECOMPUTE), ("export", EXPORT), ("train", TRAIN)]
)
def test_each_line_ends_with_the_commands_advice(
    command: str, advised: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(advice, "_advice", advice.TRAIN)
    advice.set_command(command)
    peer, timeout, collective, watchdog, code = _lines(capsys, monkeypatch)
    assert peer == (
        "rank 0: OSError: disk full (this rank was waiting for global rank 0 to prepare the data); " + advised
    )
    assert timeout == (
        "waited 0 s (train.file_wait_timeout) for global rank 0 to write final/; a rank is stuck or a node is "
        f"gone: its own error, if any, is in its log; {advised}"
    )
    assert collective == (
        "a collective failed because another rank or node is gone (Connection closed by peer: 10.0.0.2); its own "
        f"error, if any, is reported above; {advised}"
    )
    assert watchdog.endswith(
        "error: rank 0 stopped responding 12 s ago (its process or node is gone); stopping this job "
        f"({advised})"
    )
    assert code == "exit 1"


def test_library_use_and_commands_without_ranks_keep_trains_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(advice, "_advice", advice.TRAIN)
    assert advice.next_step() == TRAIN  # coati_kto.train.train: no command set
    for command in ("prepare", "plan", None):
        advice.set_command("export")
        advice.set_command(command)
        assert advice.next_step() == TRAIN


@pytest.mark.parametrize(
    "command, advised", [("precompute", PRECOMPUTE), ("export", EXPORT), ("train", TRAIN)]
)
def test_the_cli_sets_the_commands_advice_before_anything_runs(
    command: str, advised: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main`` sets it first (here the config is missing: the command ends at once, exit 2), on every rank."""
    from coati_kto.cli import main

    monkeypatch.setattr(advice, "_advice", "unset")
    monkeypatch.setattr(sys, "argv", ["coati-kto"])
    extra = ["--checkpoint", "latest"] if command == "export" else []
    assert main([command, *extra, str(tmp_path / "missing.yaml")]) == 2
    assert advice.next_step() == advised
