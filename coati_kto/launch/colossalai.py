"""``python -m coati_kto.colossalai_launch [colossalai run options] -m coati_kto train ...``: ``colossalai run``,
except that one failed node does not leave the launch waiting on the others forever, and a clean stop exits 75.

``colossalai run`` waits for each node's result in hostfile order over its SSH session. A node whose link went
down never answers (the session hangs until TCP gives up, 11-16 minutes), so the launch hangs even after every
reachable rank has stopped. Here the nodes are waited on together; once one has failed the others get
COATI_KTO_NODE_GRACE seconds (default 30) to report, then each silent one is named on one line and its SSH
session is closed (its ranks stop by themselves: coati_kto.runtime.watchdog). launch/colossalai_run.sh uses this.

``colossalai run`` reports each node as success or failure, and exits 1 on any failure: a clean stop (every
rank checkpointed after a signal and exited 75, coati_kto.runtime.signals) looked like a crash to whatever restarts
the job. Here a node whose command exited 75 reports "stopped", and the launch exits 75 when no node failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from multiprocessing.connection import wait
from typing import Any

from coati_kto.runtime.signals import STOP_EXIT_CODE

DEFAULT_GRACE_S = 30.0

_stopped_nodes: list[str] = []  # hosts that reported "stopped" (the launcher process's own record)


class _StopAwareConn:
    """A node runner's pipe to the launcher: "success" becomes "stopped" once its command exited 75."""

    def __init__(self, conn: Any, stopped: list[bool]) -> None:
        self.conn, self.stopped = conn, stopped

    def send(self, message: str) -> None:
        self.conn.send("stopped" if message == "success" and self.stopped else message)


def _run_on_host(hostinfo: Any, workdir: str, recv_conn: Any, send_conn: Any, env: dict) -> None:
    """ColossalAI's run_on_host (one forked process per node), with exit 75 of the node's command a clean stop
    rather than a failure: fabric raises UnexpectedExit for it, which becomes a normal return here."""
    import fabric
    from colossalai.cli.launcher import multinode_runner
    from invoke.exceptions import UnexpectedExit

    stopped: list[bool] = []

    def stop_aware(call: Any) -> Any:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return call(self, *args, **kwargs)
            except UnexpectedExit as err:
                if err.result.exited != STOP_EXIT_CODE:
                    raise
                stopped.append(True)
                return err.result

        return run

    fabric.Connection.local = stop_aware(fabric.Connection.local)
    fabric.Connection.run = stop_aware(fabric.Connection.run)
    multinode_runner.original_run_on_host(
        hostinfo, workdir, recv_conn, _StopAwareConn(send_conn, stopped), env
    )


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
                if messages[host] == "failure" and deadline is None:
                    deadline = time.monotonic() + grace
    _stopped_nodes.extend(host for host, message in messages.items() if message == "stopped")
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
    try:
        run.main(args=argv, prog_name="colossalai run")
    except SystemExit as done:
        if done.code in (None, 0) and _stopped_nodes:  # no node failed, and the ranks stopped cleanly
            print(
                f"launcher: stopped cleanly on {', '.join(_stopped_nodes)}; exit {STOP_EXIT_CODE}", flush=True
            )
            raise SystemExit(STOP_EXIT_CODE) from None
        raise
