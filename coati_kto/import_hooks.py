"""A library module's execution, wrapped: how the project changes what a third-party module does while it imports.

:class:`ExecHook` is an :class:`importlib.abc.MetaPathFinder` for a few exact module names. It finds each as the
interpreter would (``PathFinder``) and wraps its loader, so that ``run(loader, module)`` executes the module:
``run`` calls ``loader.exec_module(module)`` with what it adds around it (``coati_kto.import_compiles`` swaps
``torch.compile`` meanwhile; ``coati_kto.import_structures`` replaces a function once the module has run).
Every other module is found and executed as usual.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ExecModule = Callable[[importlib.abc.Loader, ModuleType], None]


class _HookedLoader(importlib.abc.Loader):
    """The found loader, whose ``exec_module`` goes through ``run``."""

    def __init__(self, loader: importlib.abc.Loader, run: ExecModule) -> None:
        self._loader, self._run = loader, run

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._run(self._loader, module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tracebacks and inspect
        return getattr(self._loader, name)


class ExecHook(importlib.abc.MetaPathFinder):
    """Finds the modules named ``names`` (exact names: a package's submodules are not included) with their
    execution going through ``run``."""

    def __init__(self, names: frozenset[str], run: ExecModule) -> None:
        self.names, self.run = names, run

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, self.run)
        return spec


def installed(run: ExecModule) -> bool:
    """Whether a hook with this ``run`` is on ``sys.meta_path``."""
    return any(isinstance(finder, ExecHook) and finder.run is run for finder in sys.meta_path)


def install(names: frozenset[str], run: ExecModule) -> None:
    """An :class:`ExecHook` first on ``sys.meta_path``, once per ``run``."""
    if not installed(run):
        sys.meta_path.insert(0, ExecHook(names, run))
