"""What a rank that another rank's failure ended tells the user to do next: the running command's advice.

The lines that end a rank because another failed (``store_waits``' peer failure and wait timeout,
``distributed.peer_failure``'s collective failures, ``runtime.watchdog``'s lost peer) end with it. train's is
to resume; precompute and export have nothing to resume (their ranks run the command again, which reuses what
is complete), and told ``train.resume=auto`` there, a user added a key the command does not read. The CLI sets
the command (``set_command``, every rank, before any collective); library use (``coati_kto.train``) keeps
train's.
"""

from __future__ import annotations

TRAIN = "resume with train.resume=auto"
_BY_COMMAND = {
    "train": TRAIN,
    "precompute": "run coati-kto precompute again (it reuses the prepared data and any complete reference cache)",
    "export": "run coati-kto export again",
}
_advice = TRAIN  # rebound per command (the test suite's worker ranks put it back after each task)


def set_command(command: str | None) -> None:
    """The command this process runs (``coati_kto.cli.main``, every rank, before any collective): its advice
    from now on. A command without ranks to fail (prepare, plan, ...) gets train's, as library use does."""
    global _advice
    _advice = _BY_COMMAND.get(command or "", TRAIN)


def next_step() -> str:
    """The advice that ends a line about another rank's failure (``resume with train.resume=auto`` in train)."""
    return _advice
