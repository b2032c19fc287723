"""``python -m coati_kto.colossalai_launch [colossalai run options] -m coati_kto train ...``: ``colossalai run``,
except that one failed node does not leave the launch waiting on the others forever, and a clean stop exits 75.

``colossalai run`` waits for each node's result in hostfile order over its SSH session. A node whose link went
down never answers (the session hangs until TCP gives up, 11-16 minutes), so the launch hangs even after every
reachable rank has stopped. Here the nodes are waited on together; once one has failed the others get
COATI_KTO_NODE_GRACE seconds (default 30) to report, then each silent one is named on one line and its SSH
session is closed (its ranks stop by themselves: coati_kto.runtime.watchdog). launch/colossalai_run.sh uses this.

``colossalai run`` reports each node as success or failure, and exits 1 on any failure: a clean stop (every
rank checkpointed after a signal and exited 75, coati_kto.runtime.signals) looked like a crash to whatever restarts
the job. Here a node whose command exited 75 reports "stopped", and the launch exits 75 when no node failed. The
CLI's other documented codes pass through the same way: 2 (a user mistake, said in one line by the ranks) and 3
(the upload of final/ failed), instead of 1 after a dump of the exported environment.

``colossalai run`` joins the script's arguments into one shell command unquoted: a config path with a space, an
override holding a space, brackets or quotes (``data.train_files=[a.jsonl, b.jsonl]``) or a ``$`` reached the ranks
split, stripped or expanded. Each is quoted here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shlex
import sys
import time
from multiprocessing.connection import wait
from typing import Any

from coati_kto.errors import USER_ERROR_EXIT_CODE
from coati_kto.runtime.signals import STOP_EXIT_CODE

DEFAULT_GRACE_S = 30.0

USER_ERROR_EXIT, PUSH_FAILED_EXIT = 2, 3  # coati_kto.cli's codes
PASSED_EXITS = (STOP_EXIT_CODE, USER_ERROR_EXIT, PUSH_FAILED_EXIT)

_node_exits: dict[str, int] = {}  # host -> its command's passed exit code (the launcher process's own record)


class _ExitAwareConn:
    """A node runner's pipe to the launcher: "success" becomes "stopped" once its command exited 75, "exited N"
    once it exited 2 or 3."""

    def __init__(self, conn: Any, exited: list[int]) -> None:
        self.conn, self.exited = conn, exited

    def send(self, message: str) -> None:
        if message == "success" and self.exited:
            code = self.exited[-1]
            message = "stopped" if code == STOP_EXIT_CODE else f"exited {code}"
        self.conn.send(message)


def _run_on_host(hostinfo: Any, workdir: str, recv_conn: Any, send_conn: Any, env: dict) -> None:
    """ColossalAI's run_on_host (one forked process per node), with exit 75, 2 or 3 of the node's command passed on
    rather than a failure: fabric raises UnexpectedExit for them, which becomes a normal return here."""
    import fabric
    from colossalai.cli.launcher import multinode_runner
    from invoke.exceptions import UnexpectedExit

    exited: list[int] = []

    def exit_aware(call: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return call(self, *args, **kwargs)
            except UnexpectedExit as err:
                if err.result.exited not in PASSED_EXITS:
                    raise
                exited.append(err.result.exited)
                return err.result

        return run

    fabric.Connection.local = exit_aware(fabric.Connection.local)
    fabric.Connection.run = exit_aware(fabric.Connection.run)
    # Its cd escapes spaces only: the command's own quoted cd (``_quoting``) goes to ``workdir``.
    multinode_runner.original_run_on_host(hostinfo, "/", recv_conn, _ExitAwareConn(send_conn, exited), env)


def _recv_from_all(self) -> dict[str, str]:
    """MultiNodeRunner.recv_from_all, with every node waited on at once and a grace period after a failure."""
    grace = float(os.environ.get("COATI_KTO_NODE_GRACE", DEFAULT_GRACE_S))
    pending = dict(self.master_recv_conns)
    messages: dict[str, str] = {}
    deadline: float | None = None
    while pending:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(pending.values()), timeout)
        if not ready:  # the grace period is over
            for host in pending:
                print(
                    f"launcher: node {host} had not finished {grace:.0f} s after another node failed: stopped "
                    "waiting for it (unreachable, or waiting for the failed node; its ranks stop on their own)",
                    file=sys.stderr,
                    flush=True,
                )
                messages[host] = "failure"
                self.processes[host].terminate()  # closes its SSH session
                self.master_send_conns.pop(host, None)
            break
        for host, conn in list(pending.items()):
            if conn in ready:
                try:
                    messages[host] = conn.recv()
                except EOFError:  # its runner process was terminated above, in an earlier call
                    messages[host] = "finish"
                del pending[host]
                failed = messages[host] == "failure" or messages[host].startswith("exited ")
                if failed and deadline is None:
                    deadline = time.monotonic() + grace
    for host, message in messages.items():
        if message == "stopped" or message.startswith("exited "):
            _node_exits[host] = STOP_EXIT_CODE if message == "stopped" else int(message.split()[1])
    return messages


def _stop_all(self) -> None:
    for conn in self.master_send_conns.values():
        with contextlib.suppress(OSError):
            conn.send("exit")


def main(argv: list[str] | None = None) -> None:
    from colossalai.cli.launcher import multinode_runner, run
    from colossalai.cli.launcher.multinode_runner import MultiNodeRunner

    MultiNodeRunner.recv_from_all = _recv_from_all
    MultiNodeRunner.stop_all = _stop_all
    # connect() forks one process per node with the module's run_on_host: the forked copies get this one.
    multinode_runner.original_run_on_host = multinode_runner.run_on_host
    multinode_runner.run_on_host = _run_on_host
    commands = importlib.import_module(
        "colossalai.cli.launcher.run"
    )  # the module; ``run`` is its click command
    commands.get_launch_command = _quoting(commands.get_launch_command)
    _leave_out_of_the_export_line()
    try:
        run.main(args=argv, prog_name="colossalai run")
    except SystemExit as done:
        # ColossalAI ends its own checks (no such hostfile, a host twice, an unknown --include host) with a bare
        # exit() after one line: a user mistake, not the success its status None would say.
        if done.code is None:
            raise SystemExit(USER_ERROR_EXIT_CODE) from None
        if done.code != 0 or not _node_exits:  # a node failed, or every node succeeded
            raise
        # No node failed: the most basic passed code wins (a user mistake, then a failed upload, then a stop).
        code = min(_node_exits.values())
        hosts = ", ".join(host for host, exited in _node_exits.items() if exited == code)
        what = "stopped cleanly" if code == STOP_EXIT_CODE else "the command exited"
        print(f"launcher: {what} on {hosts}; exit {code}", flush=True)
        raise SystemExit(code) from None


def _quoting(get_launch_command: Any) -> Any:
    """ColossalAI's get_launch_command with the script and each of its arguments shell-quoted (it joins them into
    the command each node's shell runs), after a quoted ``cd`` to this directory: ColossalAI's own ``cd`` (its
    node runner's workdir, here ``/``: ``_run_on_host``) escapes spaces only, so a repository path holding a
    quote or a ``$`` broke every node's command. ``master_addr`` (MASTER_ADDR) is quoted too: ``;`` or ``$()`` in
    it ran as a command on every node."""

    def quoted(*args: Any, user_script: str, user_args: list[str], **kwargs: Any) -> str:
        user_args = [shlex.quote(a) for a in user_args]
        if args:  # master_addr is the first parameter, passed by position or by name
            args = (shlex.quote(str(args[0])), *args[1:])
        elif "master_addr" in kwargs:
            kwargs["master_addr"] = shlex.quote(str(kwargs["master_addr"]))
        command = get_launch_command(
            *args, user_script=shlex.quote(user_script), user_args=user_args, **kwargs
        )
        return f"cd {shlex.quote(os.getcwd())} && {command}"

    return quoted


def _leave_out_of_the_export_line() -> None:
    """Take out of this process's environment what ColossalAI's ``export K="V" ...`` line (run by every node's
    shell, over SSH, printed whole when a node fails) cannot carry or must not: a value holding ``$``, a double
    quote, a backquote or a backslash (it broke the line, or ran as a command on every node) and secret-looking
    names (``unexportable``: credentials reach the nodes as files). One line names them."""
    from coati_kto.parallel.launch_env import unexportable

    dropped = unexportable(os.environ)
    for name in dropped:
        del os.environ[name]
    if dropped:
        print(f"launcher: not passed to the nodes: {', '.join(dropped)}", file=sys.stderr, flush=True)
