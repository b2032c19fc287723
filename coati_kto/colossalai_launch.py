"""``python -m coati_kto.colossalai_launch [colossalai run options] -m coati_kto train ...``: ``colossalai run``,
except that one failed node does not leave the launch waiting on the others forever.

``colossalai run`` waits for each node's result in hostfile order over its SSH session. A node whose link went
down never answers (the session hangs until TCP gives up, 11-16 minutes), so the launch hangs even after every
reachable rank has stopped. Here the nodes are waited on together; once one has failed the others get
COATI_KTO_NODE_GRACE seconds (default 30) to report, then each silent one is named on one line and its SSH
session is closed (its ranks stop by themselves: coati_kto.watchdog). launch/colossalai_run.sh uses this.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from multiprocessing.connection import wait

DEFAULT_GRACE_S = 30.0


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
    return messages


def _stop_all(self) -> None:
    for conn in self.master_send_conns.values():
        with contextlib.suppress(OSError):
            conn.send("exit")


def main(argv: list[str] | None = None) -> None:
    from colossalai.cli.launcher import run
    from colossalai.cli.launcher.multinode_runner import MultiNodeRunner

    MultiNodeRunner.recv_from_all = _recv_from_all
    MultiNodeRunner.stop_all = _stop_all
    run.main(args=argv, prog_name="colossalai run")


if __name__ == "__main__":
    main()
