"""A pytest plugin: the folders a fixture wider than a test makes with ``tmp_path_factory.mktemp`` are removed
when that fixture is torn down, not at the end of the run.

pytest's ``tmp_path_retention_policy`` removes a passed test's ``tmp_path`` but keeps every module fixture's
folder until the run ends: a whole run held 0.5 GB of checkpoints and bench outputs. A folder is kept when a
test failed while its fixture was alive (the post-mortem, as the "failed" policy keeps a failed test's
``tmp_path``). Per process: each xdist worker has its own base folder.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

_MADE: dict[pytest.FixtureDef, set[Path]] = {}
_FAILED_BEFORE: dict[pytest.FixtureDef, int] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
    factory = getattr(request.config, "_tmp_path_factory", None)
    if fixturedef.scope == "function" or factory is None:  # tmp_path's own policy covers a test's folder
        yield
        return
    base = factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    # a fixture this one asked for by getfixturevalue has claimed its own folders already
    made = set(base.iterdir()) - before - set().union(*_MADE.values())
    if made:
        _MADE[fixturedef] = made
        _FAILED_BEFORE[fixturedef] = failed


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> None:
    """After the fixture's own teardown, which may still read its folder (a cluster it stops)."""
    made = _MADE.pop(fixturedef, set())
    if request.session.testsfailed == _FAILED_BEFORE.pop(fixturedef, 0):
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
