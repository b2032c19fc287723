"""coati_kto.testing.tmp_cleanup: a module fixture's folder is gone once its module ends, kept when a test of it
failed (a whole run kept every module's folders, 0.5 GB, to its end)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import pytest

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    made = tmp_path_factory.mktemp("module_run")
    (made / "checkpoint").write_bytes(b"0" * 1024)
    yield made
    assert (made / "checkpoint").exists()  # the fixture's own teardown still sees its folder

def test_uses(folder):
    assert folder.exists()

def test_outcome(folder):
    assert {outcome}
"""


@pytest.mark.parametrize(("outcome", "kept"), [("True", False), ("False", True)])
def test_a_module_fixtures_folder_is_removed_at_its_teardown_unless_a_test_failed(
    pytester: pytest.Pytester, outcome: str, kept: bool
) -> None:
    pytester.makepyfile(test_two=TESTS.format(outcome=outcome), test_one="def test_later():\n    pass\n")
    base = pytester.path / "base"
    result = pytester.runpytest(
        "-p", "coati_kto.testing.tmp_cleanup", f"--basetemp={base}", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=3 if not kept else 2, failed=0 if not kept else 1, errors=0)
    left = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink())
    assert left == (["module_run0"] if kept else [])
