"""coati_kto.parallel.compile_lock: the processes of one machine generate and build a graph once (two ranks
compiling together: tests/distributed/test_compile.py)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from coati_kto.parallel import compile_lock


class _Graph:
    code = "def forward(self, x): return x + 1"


def test_a_nested_compile_runs_unlocked_and_a_long_wait_compiles_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compile inside a compile does not take a second lock (it would wait on its own thread); a rank that
    waited WAIT_S for another's build builds the graph itself, with a warning."""
    from filelock import FileLock

    monkeypatch.setattr("torch._inductor.codecache.get_lock_dir", lambda: str(tmp_path))
    inputs = [torch.zeros(2, 3)]
    calls: list[str] = []

    def inner(gm: Any, example_inputs: Any, **kwargs: Any) -> str:
        calls.append(kwargs["name"])
        if kwargs["name"] == "outer":
            return wrapped(gm, example_inputs, name="nested")
        return kwargs["name"]

    wrapped = compile_lock._locked(inner)
    assert wrapped(_Graph(), inputs, name="outer") == "nested" and calls == ["outer", "nested"]

    monkeypatch.setattr(compile_lock, "WAIT_S", 0.2)
    path = tmp_path / f"coati-graph-{compile_lock.graph_key(_Graph(), inputs)}.lock"
    with FileLock(str(path)), caplog.at_level(logging.WARNING, logger=compile_lock.__name__):
        # the lock is held by another owner (a second FileLock object on the same file)
        assert compile_lock._locked(lambda gm, xs: "built here")(_Graph(), inputs) == "built here"
    assert "compiling it here" in caplog.text


def test_install_is_idempotent_and_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx

    original = compile_fx._compile_fx_inner
    monkeypatch.setattr(compile_fx, "_compile_fx_inner", getattr(original, "__wrapped__", original))
    monkeypatch.setenv("COATI_KTO_NO_COMPILE_LOCK", "1")
    assert compile_lock.install() is False
    assert not getattr(compile_fx._compile_fx_inner, "coati_compile_lock", False)
    monkeypatch.delenv("COATI_KTO_NO_COMPILE_LOCK")
    assert compile_lock.install() is True
    once = compile_fx._compile_fx_inner
    assert once.coati_compile_lock and compile_lock.install() is True and compile_fx._compile_fx_inner is once
    assert os.environ.get("COATI_KTO_NO_COMPILE_LOCK") is None
