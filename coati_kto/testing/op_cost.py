"""The cost of one aten op as a GPU would run it, for the kernel counter (``coati_kto.testing.kernels``): the
kernels it launches and the bytes it reads and writes (rules in that module's docstring)."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

_NOT_KERNELS = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "set_", "resize_", "_local_scalar_dense", "record_stream", "is_same_size", "_has_compatible_shallow_copy_type",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_resize_output_", "is_nonzero",
    "_record_function_enter_new", "_record_function_exit", "_unsafe_view", "_reshape_alias", "view",
}  # fmt: skip
_GATHERS = {"embedding", "index", "index_select", "gather", "take"}
_WRITE_ONLY = {
    "zero_", "fill_", "normal_", "uniform_", "random_", "ones_like", "zeros_like", "full_like", "new_zeros",
    "new_ones", "new_full",
}  # fmt: skip
# CUDA multi-tensor apply: tensors per launch by the number of tensor lists, chunks of 65536 elements, 320
# chunks per launch (ATen's MultiTensorApply.cuh).
_MTA_TENSORS = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_MTA_CHUNK, _MTA_BLOCKS = 65536, 320


def _bytes(t: torch.Tensor) -> int:
    """Memory a kernel touches for ``t``: its elements, a broadcast (stride 0) dimension counted once."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    return min(t.numel(), span) * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _launches(args: tuple, fused: bool = False) -> int:
    """CUDA launches of a multi-tensor op (ATen's multi_tensor_apply: a launch when the tensors per launch or
    the chunks per launch are full, an unfinished tensor carried into the next)."""
    lists = [a for a in args if isinstance(a, list | tuple) and a and isinstance(a[0], torch.Tensor)]
    lists = [a for a in lists if a[0].dim() or not fused]  # fused: 0-dim step counts are no list (depth 4)
    if not lists:
        return 1
    per_launch = _MTA_TENSORS.get(len(lists), 30)
    launches = tensors = chunks = 0
    for t in lists[0]:
        count = -(-t.numel() // _MTA_CHUNK)
        if count == 0:
            continue
        tensors += 1
        for chunk in range(count):
            chunks += 1
            last = chunk == count - 1
            if chunks == _MTA_BLOCKS or (tensors == per_launch and last):
                launches, chunks, tensors = launches + 1, 0, 0 if last else 1
    return launches + (1 if chunks else 0)


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def op_cost(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int, int]:
    """(kernels, bytes read, bytes written) of one aten op call; (0, 0, 0) for views and allocations."""
    name = func.overloadpacket.__name__
    if name in _NOT_KERNELS or func.namespace == "profiler" or _is_view(func):
        return 0, 0, 0
    inputs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
    # In place: what it writes (a foreach returns None). Fused optimizers store their (mutable) grads only when
    # they unscale them (grad_scale: ATen's fused_adam_utils.cuh, FusedAdamKernel.cpp); else grads are read.
    keep_grads = not name.startswith("_fused_") or kwargs.get("grad_scale") is not None
    mutated = [
        args[i] if i < len(args) else kwargs.get(spec.name)
        for i, spec in enumerate(func._schema.arguments)
        if spec.alias_info is not None and spec.alias_info.is_write and (keep_grads or spec.name != "grads")
    ]
    outputs = _tensors(mutated) if mutated else _tensors(out)
    if not inputs and not outputs or any(t.is_meta or is_fake(t) for t in inputs[:1]):
        return 0, 0, 0  # no tensor, or torch.compile tracing (fake or meta tensors)
    written = sum(_bytes(t) for t in outputs)
    if name in _GATHERS:  # reads its indices and the gathered rows, not the whole table
        read = written + sum(_bytes(t) for t in inputs[1:] if not t.is_floating_point())
    elif name in ("copy_", "_foreach_copy_"):  # reads the source(s) only
        read = sum(_bytes(t) for t in _tensors(args[1]))
    elif name in _WRITE_ONLY:
        read = 0
    else:
        read = sum(_bytes(t) for t in inputs)
    kernels = _launches(args, name.startswith("_fused_")) if name.startswith(("_foreach_", "_fused_")) else 1
    return kernels, read, written
