"""Counting the host syncs of a piece of code on any device, as CUDA counts them: the calls that make the host
wait for the device. On CPU nothing waits, but the same calls run, so the count a CPU test sees is the count a
GPU step pays. Counted:

- reading a value back: ``item``/``float``/``int``/``bool`` of a tensor, ``tolist``, ``cpu``, ``numpy``,
  ``.to("cpu")`` (a device argument written as the string ``"cpu"``: code that names the host), not
  ``non_blocking`` copies;
- data-dependent shapes: ``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
  ``repeat_interleave`` by a tensor, ``torch.equal``;
- a pageable host-to-device copy: ``torch.tensor``/``as_tensor`` of Python data with a ``device`` other than
  the string ``"cpu"`` (CUDA copies it and synchronizes the stream);
- explicit synchronization: ColossalAI's accelerator ``synchronize`` (a no-op on the CPU accelerator that
  ``coati_kto.parallel.upstream.cpu`` installs, counted all the same), ``torch.cuda.synchronize``, CUDA stream and
  event ``synchronize``.

torch.optim's own ``.item()`` on its step counters is not counted: they live on the host (capturable=False);
nor are dynamo's guards on host scalars (``_reads_host_values``).
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
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
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
}
_READ_BACK = {
    "tolist",
    "cpu",
    "numpy",
}  # Tensor methods that copy to the host (function level: no aten op on CPU)
_NEW_TENSOR = {"tensor", "as_tensor"}
_MODEL_CODE = ("/transformers/models/", "/transformers/modeling_", "/transformers/masking", "/shardformer/")


def _bool_index(func: Any, args: tuple) -> bool:
    if (
        func is not _aten.index.Tensor
        and func is not _aten.index_put_.default
        and func is not _aten.index_put.default
    ):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _reads_host_values() -> bool:
    """A read that never waits for a GPU: torch.optim's step counters (on the CPU: capturable=False), and
    dynamo's guards, which read values only of host scalars (``MixedAdamW``'s lr and coefficients, 0-dim CPU
    tensors; a device tensor is guarded by its metadata)."""
    frame = sys._getframe(2)
    for _ in range(10):
        if frame is None:
            return False
        code = frame.f_code
        if "torch/optim/" in code.co_filename or (code.co_filename == "<string>" and code.co_name == "guard"):
            return True
        frame = frame.f_back
    return False


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "coati_kto" in frame.filename and "testing/" not in frame.filename:
            return f"{frame.filename.split('coati_kto/')[-1]}:{frame.lineno}"
    return "outside coati_kto"


def _names_host(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def function_sync(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The sync kind of a torch-level call, or None."""
    name = getattr(func, "__name__", "")
    if name in _READ_BACK:
        return name
    if name == "to" and not kwargs.get("non_blocking", False):
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        return "to_cpu" if _names_host(device) else None
    if name in _NEW_TENSOR and func in (torch.tensor, torch.as_tensor):
        device = kwargs.get("device")
        data = args[0] if args else kwargs.get("data")
        pageable = device is not None and not _names_host(device) and not isinstance(data, torch.Tensor)
        return "host_to_device" if pageable else None
    return None


def dispatch_sync(func: Any, args: tuple) -> str | None:
    """The sync kind of an aten op (below autograd), or None."""
    if func in SYNC_OPS or _bool_index(func, args):
        return "bool_index" if func not in SYNC_OPS else str(func.overloadpacket.__name__)
    return None


class SyncRecord:
    """The syncs seen: ``by_op`` (kind -> count), ``by_place`` (innermost coati_kto line -> count), ``in_model``
    (of the total, inside a model's own forward: transformers / shardformer code)."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        self.by_place: Counter[str] = Counter()
        self.in_model = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, kind: str) -> None:
        if _reads_host_values():
            return
        self.by_op[kind] += 1
        self.by_place[_caller()] += 1
        if any(part in f.filename for f in traceback.extract_stack() for part in _MODEL_CODE):
            self.in_model += 1


@contextlib.contextmanager
def counting_synchronize(add: Callable[[str], None]) -> Iterator[None]:
    """Calls to every synchronize (ColossalAI's accelerator, torch.cuda, CUDA streams and events) reported to
    ``add`` while inside; one per outermost call (the CUDA accelerator's synchronize calls torch.cuda's)."""
    depth = [0]
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, kind: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def counted(*a: Any, **k: Any) -> Any:
            if depth[0] == 0:
                add(kind)
            depth[0] += 1
            try:
                return original(*a, **k)
            finally:
                depth[0] -= 1

        patched.append((owner, attr, original))
        setattr(owner, attr, counted)

    try:
        from colossalai.accelerator import get_accelerator

        wrap(get_accelerator(), "synchronize", "synchronize")
    except ImportError:  # the counter also serves code without ColossalAI
        pass
    wrap(torch.cuda, "synchronize", "synchronize")
    wrap(torch.cuda.Stream, "synchronize", "synchronize")
    wrap(torch.cuda.Event, "synchronize", "synchronize")
    try:
        yield
    finally:
        for owner, attr, original in reversed(patched):
            if owner is not torch.cuda.Stream and owner is not torch.cuda.Event and owner is not torch.cuda:
                delattr(owner, attr)  # the accelerator instance: its class's method shows again
            else:
                setattr(owner, attr, original)


class _Dispatch(TorchDispatchMode):
    def __init__(self, record: SyncRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = dispatch_sync(func, args)
        if kind is not None:
            self.record.add(kind)
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    def __init__(self, record: SyncRecord) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = function_sync(func, args, kwargs)
        if kind is not None:
            self.record.add(kind)
        return func(*args, **kwargs)


class HostSyncCounter(SyncRecord):
    """``with HostSyncCounter() as syncs: ...``; then ``syncs.total``, ``syncs.by_op`` (kind -> count),
    ``syncs.by_place`` (coati_kto line -> count) and ``syncs.in_model``. Any thread's code that runs inside."""

    def __enter__(self) -> HostSyncCounter:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(counting_synchronize(self.add))
        self._stack.enter_context(_Functions(self))
        self._stack.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
