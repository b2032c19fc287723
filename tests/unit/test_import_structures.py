"""transformers' lazy-module import structures from the disk cache (coati_kto.import_structures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from transformers.utils import import_utils

from coati_kto import import_hooks, import_structures
from coati_kto.import_structures import cached, fingerprint

ORIGINAL = getattr(import_utils.define_import_structure, "__wrapped__", import_utils.define_import_structure)
MODELS = Path(transformers.__file__).parent / "models"


def _uncached(*args: object, **kwargs: object) -> object:
    ORIGINAL.cache_clear()  # transformers memoizes both: every call here reads the files again
    import_utils.create_import_structure_from_path.cache_clear()
    return ORIGINAL(*args, **kwargs)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "coati_kto" / "import_structures"


def _refuse(*args: object, **kwargs: object) -> object:
    raise AssertionError("transformers' function was called: the cache was not read")


def test_transformers_models_from_the_cache_equal_the_files(cache: Path) -> None:
    """Both of transformers' call forms (a package's __init__.py; a directory with a prefix): written on the first
    call, read back on the next equal to what the files give."""
    calls = [((str(MODELS / "__init__.py"),), {}), ((MODELS,), {"prefix": "models"})]
    for args, kwargs in calls:
        expected = _uncached(*args, **kwargs)
        assert cached(_uncached, "v")(*args, **kwargs) == expected
        assert cached(_refuse, "v")(*args, **kwargs) == expected
    assert len(list(cache.glob("*.json"))) == 2
    with pytest.raises(AssertionError, match="not read"):  # another transformers version: another key
        cached(_refuse, "w")(str(MODELS / "__init__.py"))


def _package(root: Path, names: list[str]) -> Path:
    (root / "sub").mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "things.py").write_text(f"__all__ = {names!r}\n")
    return root / "__init__.py"


def test_a_changed_or_added_file_is_read_again(cache: Path, tmp_path: Path) -> None:
    init = _package(tmp_path / "pkg", ["A"])
    assert cached(_uncached, "v")(str(init)) == {frozenset(): {"sub.things": {"A"}}}
    before = fingerprint(str(init))
    things = tmp_path / "pkg" / "sub" / "things.py"
    things.write_text("__all__ = ['A', 'B']\n")
    os.utime(things, ns=(1, 1))  # a new mtime even within the filesystem's timestamp resolution
    assert fingerprint(str(init)) != before
    assert cached(_uncached, "v")(str(init)) == {frozenset(): {"sub.things": {"A", "B"}}}
    (tmp_path / "pkg" / "sub" / "more.py").write_text("__all__ = ['C']\n")
    assert cached(_uncached, "v")(str(init)) == {frozenset(): {"sub.things": {"A", "B"}, "sub.more": {"C"}}}


def test_an_unwritable_cache_gives_transformers_own_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))  # its subdirectories cannot be made
    init = _package(tmp_path / "pkg", ["A"])
    assert cached(_uncached, "v")(str(init)) == {frozenset(): {"sub.things": {"A"}}}
    with pytest.raises(TypeError):  # a signature it does not know goes to transformers' function as it is
        cached(_uncached, "v")(str(init), "p", "extra")


def test_off_by_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = import_structures._exec_caching
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if getattr(f, "run", None) is not hook])
    monkeypatch.delitem(sys.modules, import_structures.MODULE)
    monkeypatch.setenv(import_structures.SWITCH, "1")
    import_structures.install()
    assert not import_hooks.installed(hook)
    monkeypatch.delenv(import_structures.SWITCH)
    import_structures.install()
    assert isinstance(sys.meta_path[0], import_hooks.ExecHook) and sys.meta_path[0].run is hook


def test_a_new_process_imports_transformers_through_the_cache(tmp_path: Path) -> None:
    """Importing coati_kto first (as every entry point does) puts the cached function in place before transformers'
    packages bind it; their lazy modules then resolve classes as before."""
    code = (
        "import coati_kto, transformers, transformers.utils.import_utils as u\n"
        "from transformers import LlamaForCausalLM, AutoTokenizer\n"
        "print(hasattr(u.define_import_structure, '__wrapped__'), LlamaForCausalLM.__name__)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):  # the cache written, then read
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["True", "LlamaForCausalLM"]
    assert list((tmp_path / "coati_kto" / "import_structures").glob("*.json"))


def test_no_absolute_cache_directory_writes_nothing_where_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # as "~" is when there is no home to expand it to
    init = _package(tmp_path / "pkg", ["A"])
    assert cached(_uncached, "v")(str(init)) == {frozenset(): {"sub.things": {"A"}}}
    assert not (tmp_path / "relative").exists()
