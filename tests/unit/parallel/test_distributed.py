"""``on_rank0``: rank 0 decides, every rank follows, through exactly one collective whatever rank 0 does."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import coati_kto.parallel.distributed as cd
from coati_kto.errors import ConfigError


class OneCollective:
    """A 2-rank group in-process: ``rank``'s view, with rank 0's broadcast payload given for the other rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int, sent: tuple | None = None) -> None:
        self.calls: list[tuple] = []
        self.sent = sent
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(cd, "broadcast_object", self.broadcast)

    def broadcast(self, obj: tuple, src: int = 0) -> tuple:
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
    assert rank0.calls == [("user", ConfigError, "cfg.yaml: model.path: not found")]
    OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    with pytest.raises(ConfigError, match="^cfg.yaml: model.path: not found$"):
        cd.on_rank0(lambda: None, "x")


def test_internal_error_reraised_on_rank0_named_on_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    def crash() -> None:
        raise KeyError("digest")

    rank0 = OneCollective(monkeypatch, 0)
    with pytest.raises(KeyError):  # the original exception, with its traceback, on the rank that failed
        cd.on_rank0(crash, "check the reference cache")
    assert len(rank0.calls) == 1
    OneCollective(monkeypatch, 1, sent=rank0.calls[0])
    with pytest.raises(RuntimeError, match="^global rank 0 failed to check the reference cache: KeyError"):
        cd.on_rank0(lambda: None, "check the reference cache")


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
