"""Where a pytest run's CPU goes: each test's CPU seconds, its own process's and every process it started.

``make test`` is bound by the CPU of 2 cores, so a test's wall time says little: it waits on a launch, on a
rendezvous, or on the other worker's load. This plugin (tests/conftest.py loads it) measures, when
``COATI_KTO_CPU_REPORT=DIR`` is set, the CPU a test costs: before and after each test, the CPU seconds of the
pytest process and of every live process under it (the fork server, the worker pool's ranks, launched
``coati-kto`` runs, gcc under inductor), with what each has reaped. Each pytest process writes
``DIR/cpu-<worker>-<pid>.json`` (``[[test id, CPU s, wall s], ...]``); the run (the xdist controller, or the
only process) ends its summary with CPU minutes per test folder and the costliest tests.

Not counted: processes that left the tree (a daemon, a node's sshd session in the drills, an SSH launch's remote
ranks). The walk over the process tree costs about a millisecond a test. Unset, nothing is measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest

REPORT_ENV = "COATI_KTO_CPU_REPORT"
SHOWN = 10  # the costliest tests in the summary

_rows: list[tuple[str, float, float]] = []
_worker_files: list[str] = []


def tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every live process under it, each with its reaped
    children's: what the tree has used so far."""
    me = psutil.Process()
    total = sum(me.cpu_times()[:4])  # user, system, children_user, children_system
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile: its parent's reaped time has it
            times = child.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test's setup, call and teardown, measured (module fixtures land on the test that set them up)."""
    if not os.environ.get(REPORT_ENV):
        yield
        return
    cpu, wall = tree_cpu(), time.monotonic()
    yield
    _rows.append((item.nodeid, tree_cpu() - cpu, time.monotonic() - wall))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Every pytest process with tests writes its rows; an xdist worker hands the file's name to the controller."""
    folder = os.environ.get(REPORT_ENV)
    if not folder or not _rows:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    path = Path(folder) / f"cpu-{worker}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_rows))
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["cpu_report"] = str(path)
    else:
        _worker_files.append(str(path))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The xdist controller: a worker ended; its rows' file."""
    if path := getattr(node, "workeroutput", {}).get("cpu_report"):
        _worker_files.append(path)


def summary_lines(rows: list[tuple[str, float, float]], shown: int = SHOWN) -> list[str]:
    """CPU and wall minutes per test folder (``tests/<folder>/...``), the total, then the ``shown`` costliest."""
    by_folder: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for test, cpu, wall in rows:
        parts = test.split("::")[0].split("/")
        folder = by_folder[parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]]
        folder[0], folder[1], folder[2] = folder[0] + cpu, folder[1] + wall, folder[2] + 1
    lines = [f"CPU by folder ({REPORT_ENV}): folder, tests, CPU min, wall min (of the process running it)"]
    for name, (cpu, wall, count) in sorted(by_folder.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name:<14} {count:5d} {cpu / 60:7.1f} {wall / 60:7.1f}")
    total = sum(r[1] for r in rows)
    lines.append(f"  {'all':<14} {len(rows):5d} {total / 60:7.1f} {sum(r[2] for r in rows) / 60:7.1f}")
    lines.append(f"the {shown} costliest tests, CPU s (wall s):")
    lines += [
        f"  {cpu:7.1f} ({wall:.1f}) {test}" for test, cpu, wall in sorted(rows, key=lambda r: -r[1])[:shown]
    ]
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not os.environ.get(REPORT_ENV) or not _worker_files:
        return
    rows = [tuple(row) for path in _worker_files for row in json.loads(Path(path).read_text())]
    for line in summary_lines(rows):  # type: ignore[arg-type]
        terminalreporter.write_line(line)
