"""coati_kto.testing.cpu_report: a test's CPU seconds are its own process's and every process it started (a
launch's ranks, gcc), not its wall time; the summary sums them per folder."""

from __future__ import annotations

import json

import pytest

from coati_kto.testing.cpu_report import REPORT_ENV, summary_lines

pytest_plugins = ["pytester"]

TESTS = """
import subprocess, sys, time

BURN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end:\\n    pass"

def test_a_child_burns_cpu():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_waits():
    time.sleep(0.6)
"""


def test_a_childs_cpu_counts_for_its_test_and_waiting_does_not(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = pytester.path / "cpu"
    monkeypatch.setenv(REPORT_ENV, str(folder))
    pytester.makepyfile(test_costs=TESTS)
    result = pytester.runpytest_subprocess("-p", "coati_kto.testing.cpu_report", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    (report,) = folder.glob("cpu-*.json")  # cpu-main-PID, or cpu-gwN-PID under xdist (its variable)
    rows = {test.split("::")[1]: (cpu, wall) for test, cpu, wall in json.loads(report.read_text())}
    burned, waited = rows["test_a_child_burns_cpu"], rows["test_waits"]
    assert (
        0.6 <= burned[0] < burned[1] + 0.5
    )  # the child's 0.6 s, counted once (plus its interpreter's start)
    assert waited[0] < 0.2 and waited[1] >= 0.6
    result.stdout.fnmatch_lines(["CPU by folder*", "  test_costs.py * 2 *", "the 10 costliest tests*"])


def test_the_summary_sums_each_folder_and_lists_the_costliest() -> None:
    rows = [
        ("tests/unit/test_a.py::test_x", 30.0, 40.0),
        ("tests/unit/test_a.py::test_y", 6.0, 1.0),
        ("tests/e2e/test_b.py::test_z", 90.0, 120.0),
    ]
    assert summary_lines(rows, shown=2) == [
        f"CPU by folder ({REPORT_ENV}): folder, tests, CPU min, wall min (of the process running it)",
        "  e2e                1     1.5     2.0",
        "  unit               2     0.6     0.7",
        "  all                3     2.1     2.7",
        "the 2 costliest tests, CPU s (wall s):",
        "     90.0 (120.0) tests/e2e/test_b.py::test_z",
        "     30.0 (40.0) tests/unit/test_a.py::test_x",
    ]
