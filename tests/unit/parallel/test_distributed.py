"""``on_rank0``: rank 0 decides, every rank follows, through exactly one collective whatever rank 0 does."""

from __future__ import annotations

import pickle

import pytest
import torch.distributed as dist

import coati_kto.parallel.distributed as cd
from coati_kto.data.formats import RecordError
from coati_kto.errors import ConfigError, DataError, UserError
from coati_kto.parallel.store_waits import PeerFailedError


class OneCollective:
    """A 2-rank group in-process: ``rank``'s view, with rank 0's broadcast payload given for the other rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int, sent: tuple | None = None) -> None:
        self.calls: list[tuple] = []
        self.sent = sent
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(cd, "from_rank0", self.broadcast)

    def broadcast(self, obj: tuple, what: str) -> tuple:
        self.calls.append(obj)
        return obj if self.sent is None else self.sent


def test_rank0_result_reaches_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    rank0 = OneCollective(monkeypatch, 0)
    assert cd.on_rank0(lambda: ran.append(0) or {"digest": "abc"}, "x") == {"digest": "abc"}
    assert ran == [0] and rank0.calls == [("ok", {"digest": "abc"}, None)]
    rank1 = OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    assert cd.on_rank0(lambda: ran.append(1), "x") == {"digest": "abc"}
    assert ran == [0] and len(rank1.calls) == 1  # rank 1 never computes, and enters the one broadcast


def test_user_error_on_rank0_is_raised_everywhere_with_its_class(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise ConfigError("cfg.yaml: model.path: not found")

    rank0 = OneCollective(monkeypatch, 0)
    with pytest.raises(ConfigError, match="^cfg.yaml: model.path: not found$"):
        cd.on_rank0(fail, "x")
    assert [(kind, message) for kind, _, message in rank0.calls] == [
        ("user", "cfg.yaml: model.path: not found")
    ]
    OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    with pytest.raises(ConfigError, match="^cfg.yaml: model.path: not found$"):
        cd.on_rank0(lambda: None, "x")


def _raised_on_both(monkeypatch: pytest.MonkeyPatch, err: UserError) -> tuple[UserError, UserError]:
    """``err`` raised inside ``on_rank0`` on rank 0, and what rank 1 raises from rank 0's broadcast."""

    def fail() -> None:
        raise err

    rank0 = OneCollective(monkeypatch, 0)
    with pytest.raises(UserError) as on_rank0:
        cd.on_rank0(fail, "prepare the data")
    OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    with pytest.raises(UserError) as on_rank1:
        cd.on_rank0(lambda: None, "prepare the data")
    return on_rank0.value, on_rank1.value


def test_an_error_whose_constructor_takes_other_arguments_reaches_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RecordError(source, field, problem, reason) was rebuilt as RecordError(message) on every rank: a TypeError
    traceback instead of the record's one line (`coati-kto train` on a bad record, 1 process or 2)."""
    bad = RecordError(
        "bad.jsonl:41", "label", 'expected true/false or 0/1 (1.0/0.0), got "maybe"', "bad_label"
    )
    mine, theirs = _raised_on_both(monkeypatch, bad)
    assert mine is bad and mine.same_on_every_rank  # rank 0 raises its own, traceback and all; prints it once
    assert type(theirs) is RecordError and theirs.same_on_every_rank  # the others stay quiet (cli.main)
    line = "bad.jsonl:41: field 'label': expected true/false or 0/1 (1.0/0.0), got \"maybe\""
    assert str(mine) == str(theirs) == line
    assert (theirs.reason, theirs.source) == ("bad_label", "bad.jsonl:41")


class _UnpicklableError(UserError):
    def __init__(self, message: str, handle: object) -> None:
        super().__init__(message)
        self.handle = handle


def test_an_error_that_cannot_travel_whole_still_gives_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attribute that cannot be pickled: its class alone travels. A class rank 1 cannot import (defined in a
    function): a plain UserError with the same message. Rank 0's broadcast never fails on rank 0 alone."""
    mine, theirs = _raised_on_both(monkeypatch, _UnpicklableError("a.yaml: x: no", handle=lambda: None))
    assert type(theirs) is _UnpicklableError and str(theirs) == str(mine) == "a.yaml: x: no"
    assert not hasattr(theirs, "handle") and theirs.same_on_every_rank

    class LocalError(DataError):
        def __init__(self, path: str) -> None:
            super().__init__(f"{path}: unreadable")

    mine, theirs = _raised_on_both(monkeypatch, LocalError("d.jsonl"))
    assert type(mine) is LocalError and type(theirs) is UserError
    assert str(theirs) == "d.jsonl: unreadable" and theirs.same_on_every_rank


def test_every_user_error_pickles_whatever_its_constructor() -> None:
    bad = RecordError("t.jsonl:3", "tools", "expected a list", "bad_tools")
    again = pickle.loads(pickle.dumps(bad))
    assert (type(again), str(again), again.reason, again.source) == (
        RecordError,
        str(bad),
        "bad_tools",
        "t.jsonl:3",
    )


def test_internal_error_reraised_on_rank0_named_on_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash() -> None:
        raise KeyError("digest")

    rank0 = OneCollective(monkeypatch, 0)
    with pytest.raises(KeyError):  # the original exception, with its traceback, on the rank that failed
        cd.on_rank0(crash, "check the reference cache")
    assert len(rank0.calls) == 1
    OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    # One line on the others (cli.main prints a PeerFailedError so, exit 1): they printed a RuntimeError's traceback
    # each, rank 0's error repeated once per rank
    with pytest.raises(PeerFailedError) as raised:
        cd.on_rank0(lambda: None, "check the reference cache")
    assert cd.peer_failure(raised.value) == (
        "rank 0: KeyError: 'digest' (its traceback is in its log) (this rank was waiting for global rank 0 to check "
        "the reference cache); resume with train.resume=auto"
    )


def test_a_collective_failure_names_what_is_known() -> None:
    """A closed connection names the gone peer; a timeout (a hang looks the same as a dead peer) says gone or
    stuck: a hung ddp run used to be told "another rank or node is gone" while every rank was alive."""
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4810")
    assert cd.peer_failure(closed) == (
        "a collective failed because another rank or node is gone (Connection closed by peer: 10.0.0.2); its own "
        "error, if any, is reported above; resume with train.resume=auto"
    )
    timeout = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms"
    )
    assert cd.peer_failure(timeout) == (
        "a collective timed out after train.dist_timeout ([../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc"
        ":81] Timed out waiting 1800000ms): another rank or node is gone or stuck; its own error, if any, is "
        "reported above; resume with train.resume=auto"
    )
    assert cd.peer_failure(RuntimeError("Timed out reading the dataset")) is None
    assert cd.peer_failure(ValueError("shape mismatch")) is None
