"""``coati-kto`` (also ``python -m coati_kto``): prepare | inspect | train | precompute | export | plan | config |
tiny-model; ``--version``.

User mistakes (UserError) print one ``error:`` line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coati_kto.cli_args import check_numbers, parse
from coati_kto.errors import PUSH_FAILED_EXIT_CODE, USER_ERROR_EXIT_CODE, UserError, without_secrets
from coati_kto.parallel.advice import set_command
from coati_kto.runtime.signals import (
    ABORT_EXIT_CODE,
    STOP,
    STOP_EXIT_CODE,
    TrainingStoppedError,
    command_of,
    launches,
)
from coati_kto.runtime.startup import closed_stdout_is_quiet, hold_collection, release_collection

if TYPE_CHECKING:  # the commands import the config on demand (`--help` must not pay for it)
    from coati_kto.config.schema import Config

ABORT_GRACE_S = 2.0


def _config_command(args: argparse.Namespace) -> None:
    """``coati-kto config``: the schema, or the resolved config as YAML, on stdout."""
    if args.schema:
        if args.config or args.overrides:
            raise UserError("coati-kto config --schema takes no config file or overrides")
        from coati_kto.config.discovery import schema_lines

        print("\n".join(schema_lines()))
        return
    if not args.config:
        raise UserError("coati-kto config needs a config file (or --schema)")
    from coati_kto.config.load import load_config

    print(load_config(args.config, args.overrides).to_yaml(), end="")


def _launch_local(args: argparse.Namespace) -> int:
    """Re-run the command (train, precompute, export) under torchrun (coati_kto.launch, in this process) with N local processes; returns its
    exit status (STOP_EXIT_CODE after a clean stop on a signal)."""
    from coati_kto.launch.torchrun import main as launch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torchrun_args = ["--standalone", f"--nproc_per_node={args.nproc_per_node}"]
    options = []
    if args.command == "export":
        options = ["--checkpoint", args.checkpoint, *(["--out", args.out] if args.out else [])]
        options += ["--push"] if args.push else []
    return launch([*torchrun_args, "-m", "coati_kto", args.command, *options, args.config, *args.overrides])


def _check_before_launch(args: argparse.Namespace) -> None:
    """The config, and for train the preflight: here, once, rather than in N processes. A stop signal is looked
    at between the parts (``check_stop``), not inside them: seconds of imports each."""
    from coati_kto.config.load import load_config
    from coati_kto.launch.torchrun import check_stop

    config = load_config(args.config, args.overrides)
    if args.command == "train":
        from coati_kto.config.pipeline import check_pipeline_divides_world
        from coati_kto.parallel.plan import check_tp_divides_world
        from coati_kto.runtime.preflight import announce_resume, check_training

        check_pipeline_divides_world(config.plugin, args.nproc_per_node)
        check_tp_divides_world(config.plugin.tp_size, args.nproc_per_node, config.plugin.sp_size)
        check_stop()
        check_training(config)
        check_stop()  # before the resume line: a stopped launch does not announce one
        announce_resume(config.train, config.training_output(), launcher=True)  # before torchrun's workers
    if args.command == "export":
        from coati_kto.outputs.export import check_export

        options = (args.checkpoint, args.out, args.push)
        check_export(config.training_output(), config.model.lora, config.plugin, options, args.nproc_per_node)


def _run(args: argparse.Namespace) -> int:
    """The command itself; user mistakes raise UserError (``main`` turns them into one line and exit 2)."""
    if args.command == "config":
        _config_command(args)
        return 0
    if args.command == "tiny-model":
        _tiny_model(args)
        return 0
    # The commands' modules are imported on demand: `coati-kto config` and `--help` must not pay for torch.
    from coati_kto.config.load import load_config

    check_numbers(args)
    if launches(args.command, getattr(args, "nproc_per_node", None)):  # refused in a rank (RANK set)
        from coati_kto.launch.torchrun import before_workers

        # The launcher's signal handling (entry started it): a stop during the checks is one line, not a kill.
        stopped = before_workers(lambda: _check_before_launch(args))
        return stopped if stopped is not None else _launch_local(args)
    config = load_config(args.config, args.overrides)
    if args.command in ("prepare", "inspect"):
        _data_command(args, config)
    elif args.command == "precompute":
        from coati_kto.recipe.precompute import precompute

        release_collection()
        precompute(config)
    elif args.command == "export":
        return _export(args, config)
    elif args.command == "plan":
        from coati_kto.recipe.plan import plan_lines

        print("\n".join(plan_lines(config, args.gpus, args.gpu_memory, args.nodes)))
    else:
        from coati_kto.recipe.train import train

        # train releases the collector itself, once the plugins are imported too (recipe.train)
        return PUSH_FAILED_EXIT_CODE if getattr(train(config), "pushed", None) is False else 0
    return 0


def _tiny_model(args: argparse.Namespace) -> None:
    """``coati-kto tiny-model``: the folder written whole through ``durable.write_dir`` (a stop, under
    ``STOP.quit_on_stop`` from entry, removes the partial copy: the folder is whole, or as it was)."""
    from coati_kto.models.tiny import write_tiny_model
    from coati_kto.runtime.durable import write_dir

    if args.overrides:
        raise UserError(f"coati-kto tiny-model takes no overrides, got {' '.join(args.overrides)}")
    out = Path(args.dir)
    _check_replaceable(out)
    before = _identity(out)
    # the renamed-in folder is another inode: a stop that came as it was renamed in (held) left it complete
    STOP.leaves(lambda: _tiny_left(out, before))
    print(STOP.stoppable(lambda: write_tiny_model(out, args.seed, args.hidden_size, args.layers, write_dir)))


def _check_replaceable(out: Path) -> None:
    """Refuse (UserError, nothing written) a tiny-model folder that ``write_dir`` cannot rename aside: the
    current folder (``.``) or one holding it, and a mount point (rename(2) says EBUSY: a traceback, and an empty
    ``..coati-kto-old-`` folder left behind). Written in place there, a stop would leave it half-written."""
    here, target = Path.cwd(), Path(os.path.abspath(out))
    if target == here or target in here.parents:
        why = "the current folder or holds it"
    elif os.path.ismount(target):
        why = "a mount point"
    else:
        return
    raise UserError(
        f"coati-kto tiny-model: {out} is {why}, and the model's folder is written beside it and renamed in "
        "(a stop leaves it whole or as it was): name a folder inside it, e.g. tiny (nothing was written)"
    )


def _tiny_left(out: Path, before: tuple[int, int] | None) -> str:
    """What a stop of tiny-model leaves, for its line."""
    if _identity(out) != before:
        return f"{out} is complete"
    return f"nothing written to {out}" if before is None else f"{out} is as it was"


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of ``path``, None when absent."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _data_command(args: argparse.Namespace, config: Config) -> None:
    """``coati-kto prepare`` and ``coati-kto inspect``, after every problem of the paths they read is named."""
    from coati_kto.data.settings import PrepareSettings
    from coati_kto.data.weights import WeightSettings
    from coati_kto.runtime.preflight import check_preparing

    check_preparing(config)
    # Image records are read for a vision-language model, as train reads them (inspect refused them).
    settings = PrepareSettings(config.data, config.model, config.train.seed, images=True)
    weights = WeightSettings(config.kto, config.train.micro_batch_size)
    # A stop ends either (STOP.quit_on_stop, from entry) once its scratch folder is removed: the old build stays.
    STOP.leaves(
        f"data.prepared_dir {config.data.prepared_dir} is as it was"
        if args.command == "prepare"
        else "nothing written"
    )
    if args.command == "prepare":
        from coati_kto.data.prepared import prepare

        release_collection()  # after the imports: what they made is frozen
        STOP.stoppable(lambda: prepare(settings, weights))
    else:
        from coati_kto.data.inspect import inspect_batches

        release_collection()
        counts = {"num_ranks": args.ranks, "num_batches": args.batches, "num_examples": args.examples}
        STOP.stoppable(lambda: inspect_batches(settings, weights, **counts))


def _export(args: argparse.Namespace, config: Config) -> int:
    """``coati-kto export``; with ``--push`` the upload (exit 1 when it failed: the files stay on disk)."""
    from coati_kto.outputs.export import check_push, finished_final
    from coati_kto.outputs.push import upload
    from coati_kto.recipe.export import export_checkpoint

    release_collection()

    output = config.training_output()
    if args.push:
        check_push(output)
        final = finished_final(output, args.checkpoint, args.out)
        if final is not None:  # the run finished: upload final/ as it is, nothing to load (one rank uploads)
            main_rank = os.environ.get("RANK", "0") == "0"
            pushed = not main_rank or upload(output.push_to_hub, final, "final/ (coati-kto export --push)")
            return 0 if pushed else PUSH_FAILED_EXIT_CODE
    target = export_checkpoint(config, args.checkpoint, args.out)
    if args.push and os.environ.get("RANK", "0") == "0":
        pushed = upload(output.push_to_hub, target, f"{target.name} (coati-kto export --push)")
        return 0 if pushed else PUSH_FAILED_EXIT_CODE
    return 0


def entry() -> int:
    """The process's entry point (the ``coati-kto`` console script, ``python -m coati_kto``): ``main`` with the
    cyclic garbage collector off until the command's imports are done (coati_kto.runtime.startup). Tests and
    worker ranks call ``main`` itself. A launcher takes the stop signals from its first step (a signal handler
    raising to stop it landed inside imports: lost or a traceback); once ``main`` returned, they are ignored."""
    hold_collection()
    if STOP.block_for_launcher(sys.argv[1:]):
        from coati_kto.launch.torchrun import watch_stops

        watch_stops()
    try:
        code = closed_stdout_is_quiet(main)
    finally:
        release_collection()
    STOP.ignore_from_now()
    return code


def main(argv: list[str] | None = None) -> int:
    """``coati-kto``: exit 0 done, 2 a user mistake (one line), 3 done but the Hub upload failed (one line), 75 a
    clean stop, 1 a peer gone, 130 aborted; precompute, export, prepare, inspect, plan, config and tiny-model
    stopped by a signal: 128 + the signal (143)."""
    try:
        args = parse(argv)  # imports the config's schema (pydantic, yaml): tenths of a second
    except KeyboardInterrupt:
        return _interrupted(command_of(sys.argv[1:] if argv is None else argv), os.environ.get("RANK"))
    # before any collective: the advice of a line about another rank's failure is this command's
    set_command(args.command)
    if "RANK" in os.environ:  # a rank: stop cleanly even while still importing (train)
        STOP.start_rank(train=args.command == "train")
    rank = os.environ.get("RANK")
    code = _main(args, rank)
    if code in (0, USER_ERROR_EXIT_CODE, PUSH_FAILED_EXIT_CODE, STOP_EXIT_CODE):
        _close_process_groups()
    return code


def _close_process_groups() -> None:
    """Destroy this process's process groups while the interpreter is whole. Left to interpreter exit, gloo's
    worker threads can still hold finished work whose tensors are freed during finalization: SIGABRT
    ("terminate called without an active exception") after a 2-process ddp run had written final/. Called
    only when the ranks left their collectives together (done, a user error, a clean stop): after a peer
    failure a worker thread may still wait on the dead peer, and destroying the group would join it."""
    if "torch.distributed" not in sys.modules:  # `coati-kto config`, prepare: never imported torch's c10d
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _tell_waiting_peers(line: str) -> None:
    """This rank is leaving with an error: ranks waiting for its file work in the store stop with ``line`` at once
    (``coati_kto.parallel.store_waits.tell_peers``). Nothing where torch's c10d was never imported."""
    if "torch.distributed" in sys.modules:
        from coati_kto.parallel.store_waits import tell_peers

        tell_peers(line)


def _main(args: argparse.Namespace, rank: str | None) -> int:
    """``_run`` with every way out turned into an exit code (see ``main``)."""
    try:
        return _run(args)
    except UserError as err:
        if STOP.interrupted:  # a Ctrl-C a library swallowed (STOP._interrupt): this error is what it left
            return _interrupted(args.command, rank)
        if err.same_on_every_rank and rank not in (None, "0"):
            return USER_ERROR_EXIT_CODE  # the same on every rank: rank 0 prints it
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {without_secrets(str(err))}", file=sys.stderr)
        if not err.same_on_every_rank:
            _tell_waiting_peers(str(err))
        return USER_ERROR_EXIT_CODE
    except TrainingStoppedError as stop:
        if rank in (None, "0"):
            print(stop, file=sys.stderr, flush=True)
        return STOP_EXIT_CODE
    except Exception as err:  # a peer rank or node died: one line here, not a traceback per rank
        if STOP.interrupted:
            return _interrupted(args.command, rank)
        from coati_kto.parallel.distributed import peer_failure  # torch: only once something failed

        line = peer_failure(err)
        if line is None:
            _tell_waiting_peers(
                f"{type(err).__name__}: {err}".splitlines()[0][:300] + " (its traceback is in its log)"
            )
            raise
        if STOP.received == signal.SIGINT:  # Ctrl-C twice: the second may reach a peer first, which aborts;
            time.sleep(
                ABORT_GRACE_S
            )  # this rank's own is on its way (its handler exits 130: not "a peer gone")
        print(f"[rank {rank or '0'}] error: {line}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before train's stop handlers are installed (imports, the preflight)
        return _interrupted(args.command, rank)


def _interrupted(command: str | None, rank: str | None) -> int:
    """A Ctrl-C that came before the command's stop handlers: one line (rank 0), ABORT_EXIT_CODE."""
    if rank in (None, "0"):
        name = f"coati-kto {command}" if command else "coati-kto"
        line = f"{name} interrupted: nothing written"
        print(
            "interrupted before training started: nothing to save" if command == "train" else line,
            file=sys.stderr,
        )
    return ABORT_EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
