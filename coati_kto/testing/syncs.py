"""Counting the host syncs of a piece of code on any device: the ops that make the host wait for the device on
CUDA (reading a value back: ``item``/``float``/``bool`` of a tensor, ``nonzero`` and boolean-mask indexing whose
output size depends on the data, ``torch.equal``...). On CPU nothing waits, but the same ops run, so the count a
CPU test sees is the count a GPU step pays.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Ops whose result the host must read (or whose output shape depends on device data).
SYNC_OPS = {
    _aten._local_scalar_dense.default,  # .item(), float(t), int(t), bool(t), if t:
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
    _aten.repeat_interleave.Tensor,
}


def _bool_index(func: Any, args: tuple) -> bool:
    if (
        func is not _aten.index.Tensor
        and func is not _aten.index_put_.default
        and func is not _aten.index_put.default
    ):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _in_torch_optimizer() -> bool:
    """torch.optim's step counters live on the CPU (capturable=False): their ``.item()`` never waits for a GPU."""
    return any("torch/optim/" in frame.filename for frame in traceback.extract_stack()[-8:])


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "coati_kto" in frame.filename and "testing/syncs" not in frame.filename:
            return f"{frame.filename.split('coati_kto/')[-1]}:{frame.lineno}"
    return "outside coati_kto"


_MODEL_CODE = ("/transformers/models/", "/transformers/modeling_", "/transformers/masking", "/shardformer/")


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.total``, ``syncs.by_op`` (op name -> count),
    ``syncs.by_place`` (coati_kto line -> count) and ``syncs.in_model`` (inside a model's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.by_place: Counter[str] = Counter()  # the innermost coati_kto line that caused each sync
        self.in_model = 0  # of the total, inside a model's own forward (transformers / shardformer code)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if (func in SYNC_OPS or _bool_index(func, args)) and not _in_torch_optimizer():
            self.by_op[str(func.overloadpacket.__name__)] += 1
            self.by_place[_caller()] += 1
            if any(part in f.filename for f in traceback.extract_stack() for part in _MODEL_CODE):
                self.in_model += 1
        return func(*args, **(kwargs or {}))
