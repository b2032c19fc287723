"""``coati-kto ARGV`` as a test runs it, without a new interpreter: ``run_cli(argv, world_size)`` runs the
command's entry point on ``run_distributed``'s ranks (under pytest the worker pool, which imported everything once)
and returns what a subprocess would have given: each rank's exit status and what it wrote to its stdout and stderr
file descriptors.

What each rank sees is what the command's process would see:
- ``world_size`` 1: ``python -m coati_kto ARGV`` with no launcher variables (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT removed: the pool sets them). ``world_size`` N: one of N processes a
  launcher started, with those variables for a new rendezvous port.
- The command creates its own default process group (``init_distributed``, with the config's
  ``train.dist_timeout``) and destroys it at its end (``cli.main``'s ``_close_process_groups``), as in a process.
  The rank's own group is set aside for the call (``_set_aside``: torch's group registry emptied, nothing shut
  down) and put back after it. When the command leaves a group behind (an uncaught exception, exit 1 after a
  peer failure: a process would just exit), that group is kept, never destroyed, and the rank's group is not
  put back: the pool retires the rank after the call (``worker_pool._reset``) and the next call gets new ones.
- ``sys.argv``, the working directory (``cwd``) and ``env`` apply to the call only. ``env`` maps a name to its
  value, or to None to remove it. A variable a library reads when it is imported (``IMPORT_TIME_PREFIXES``:
  huggingface_hub's HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE; torch's threads and ISA caps) cannot change on a rank
  that imported it: such a variable is set in this process around the call instead, so ``run_distributed``
  starts fresh processes for it (its own rule for an environment that differs from the pool's).
- Output is captured at the file-descriptor level (fds 1 and 2 onto temporary files, flushed before and after):
  ``print``, logging, warnings, rich and C-level writes alike; stdout block-buffered, as into a pipe.
- The exit status: ``main``'s return value; a ``SystemExit``'s code (argparse's 2, ``--help``'s 0); an uncaught
  exception prints its traceback on stderr and gives 1, as the interpreter does.

Not reproduced: ``atexit`` handlers (they run when a rank exits, not after the call), and a signal sent to the
command (no process of its own): tests of launchers, signals and a resume that must read everything from disk
launch real processes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_all_process_groups
from torch.distributed import distributed_c10d as c10d

from coati_kto.parallel.distributed import free_port
from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.isolation import flush_output
from coati_kto.testing.worker_pool import environ

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Prefixes of variables libraries read once, at import (a pooled rank imported them already).
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DATASETS_",
    "TORCH",
    "OMP_",
    "MKL_",
    "ONEDNN_",
    "DNNL_",
    "ATEN_",
    "CUDA_",
    "PYTHON",
)
READ_AT_CALL = frozenset({"HF_TOKEN"})  # huggingface_hub reads it at each request: a rank can take it
_ABANDONED: list[Any] = []  # groups a command left behind: never destroyed here (a peer may be gone)


@dataclass(frozen=True)
class RankOutput:
    """One rank's exit status and captured output (text, UTF-8)."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class CliResult:
    """Every rank's ``RankOutput``; ``returncode``, ``stdout`` and ``stderr`` are rank 0's (the only process at
    world size 1; the one that prints a run's lines)."""

    ranks: tuple[RankOutput, ...]

    @property
    def returncode(self) -> int:
        return self.ranks[0].returncode

    @property
    def stdout(self) -> str:
        return self.ranks[0].stdout

    @property
    def stderr(self) -> str:
        return self.ranks[0].stderr

    @property
    def returncodes(self) -> list[int]:
        return [r.returncode for r in self.ranks]


def run_cli(
    argv: Sequence[str | os.PathLike],
    world_size: int = 1,
    *,
    env: Mapping[str, str | None] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout_s: float = 600,
    merge_stderr: bool = False,
    command: Callable[[list[str]], int] | None = None,
) -> CliResult:
    """``coati-kto ARGV`` on ``world_size`` ranks (see the module). ``merge_stderr``: stderr into stdout's capture,
    in the order written (``stderr=subprocess.STDOUT``). ``command``: a module-level function to run in the
    command's place, called with ``argv`` (run_cli's own tests); default the ``coati-kto`` entry point. A rank
    that fails outside the command (a timeout, a dead rank) raises RuntimeError, as ``run_distributed`` does."""
    args = [os.fspath(a) for a in argv]
    env = dict(env or {})
    at_import = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in READ_AT_CALL}
    at_call = {k: v for k, v in env.items() if k not in at_import}
    port = free_port() if world_size > 1 else None
    where = os.fspath(cwd) if cwd is not None else None
    with environ(at_import):
        results = run_distributed(
            _cli_task, world_size, args, at_call, where, port, merge_stderr, command, timeout_s=timeout_s
        )
    return CliResult(tuple(results))


def _command_env(changes: Mapping[str, str | None], port: int | None) -> dict[str, str | None]:
    """The launcher variables as the command's process would have them, then ``changes``."""
    out: dict[str, str | None] = dict.fromkeys(LAUNCHER_ENV)
    if port is not None:  # one of world_size processes a launcher started
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
        out.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world)
        out.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return {**out, **changes}


def _cli_task(
    argv: list[str],
    env: dict[str, str | None],
    cwd: str | None,
    port: int | None,
    merge: bool,
    command: Callable[[list[str]], int] | None,
) -> RankOutput:
    """One rank's run of the command (``run_cli``): its environment, cwd and argv, the rank's group set aside."""
    import coati_kto

    saved_cwd, saved_argv = os.getcwd(), list(sys.argv)
    command_env = _command_env(env, port)
    group = _set_aside()
    try:
        with environ(command_env):
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = [str(Path(coati_kto.__file__).with_name("__main__.py")), *argv]
            with _captured(merge) as out:
                code = _exit_status(argv, command)
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        if dist.is_initialized():  # left behind by the command: keep it alive, retire this rank
            _ABANDONED.append((_set_aside(), group))
        else:
            _put_back(group)
    return RankOutput(code, out["stdout"], out["stderr"])


def _exit_status(argv: list[str], command: Callable[[list[str]], int] | None) -> int:
    """What ``python -m coati_kto ARGV`` would exit with (its output goes to fds 1 and 2)."""
    if command is None:
        from importlib.metadata import entry_points

        # The installed command's module (what `coati-kto` runs; __main__ too): testing sits below cli in the
        # layers, so it names the command rather than importing it. Its `main`, not the entry point itself: the
        # entry adds the process's start-up (coati_kto.runtime.startup holds the collector while a new
        # interpreter imports), and a worker rank has imported everything already.
        (script,) = entry_points(group="console_scripts", name="coati-kto")
        command = importlib.import_module(script.module).main
    try:
        return int(command(argv) or 0)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            return exit_.code or 0
        print(exit_.code, file=sys.stderr)  # sys.exit("message"): printed, status 1
        return 1
    except Exception:  # the interpreter's way with an uncaught exception
        traceback.print_exc()
        return 1


@contextlib.contextmanager
def _captured(merge: bool) -> Iterator[dict[str, str]]:
    """fds 1 and 2 onto temporary files inside; the text written to each in the dict after (``merge``: both in
    ``stdout``)."""
    out: dict[str, str] = {"stdout": "", "stderr": ""}
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        flush_output()
        saved = os.dup(1), os.dup(2)
        line_buffering = getattr(sys.stdout, "line_buffering", False)
        try:
            os.dup2(stdout.fileno(), 1)
            os.dup2((stdout if merge else stderr).fileno(), 2)
            with contextlib.suppress(Exception):  # into a pipe, stdout is block-buffered
                sys.stdout.reconfigure(line_buffering=False)
            yield out
        finally:
            flush_output()
            with contextlib.suppress(Exception):
                sys.stdout.reconfigure(line_buffering=line_buffering)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        for name, file in (("stdout", stdout), ("stderr", stderr)):
            file.seek(0)
            out[name] = file.read().decode("utf-8", errors="replace")


# torch's registry of process groups (distributed_c10d): what destroy_process_group(WORLD) empties.
_REGISTRY = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_pg_to_tag", "_tags_to_pg")


def _set_aside() -> dict[str, Any]:
    """Take every process group out of torch's registry without shutting any down, as
    ``destroy_process_group()`` empties it: ``dist.is_initialized()`` turns False and a new default group can be
    created. ``_put_back`` installs them again."""
    world = c10d._world
    saved: dict[str, Any] = {name: dict(getattr(c10d, name)) for name in _REGISTRY}
    saved["_tags_to_pg"] = {tag: list(pgs) for tag, pgs in saved["_tags_to_pg"].items()}
    saved.update(
        default=world.default_pg,
        coalesce=dict(world.pg_coalesce_state),
        comms=list(world.comms),
        group_count=world.group_count,
        backend=c10d._backend,
        init_method=c10d._default_pg_init_method,
    )
    c10d._update_default_pg(None)
    for name in _REGISTRY:
        getattr(c10d, name).clear()
    world.pg_coalesce_state.clear()
    world.comms.clear()
    _unregister_all_process_groups()
    world.group_count = 0
    return saved


def _put_back(saved: dict[str, Any]) -> None:
    """Install the groups ``_set_aside`` took out (the registry is empty again: the command destroyed its own)."""
    world = c10d._world
    for name in _REGISTRY:
        getattr(c10d, name).update(saved[name])
    world.pg_coalesce_state.update(saved["coalesce"])
    world.comms.extend(saved["comms"])
    for pg, name in saved["_pg_names"].items():
        _register_process_group(name, pg)
    world.group_count = saved["group_count"]
    c10d._backend, c10d._default_pg_init_method = saved["backend"], saved["init_method"]
    c10d._update_default_pg(saved["default"])
