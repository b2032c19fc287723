"""What a compiled region (``coati_kto.models.compile``) launches, for the kernel counter
(``coati_kto.testing.kernels``): each kernel inductor generated is one kernel, its bytes the tensors it is
handed (read: its ``const`` pointers, written: the others), and the aten kernels the generated code calls
(matmuls, attention, fallbacks) are seen by the counter's dispatch mode as any op. Never the region's eager ops,
never zero.

How: the generated modules' kernels (``cpp_fused_*``, ``triton_*``: module globals that the generated ``call``
looks up at each run) are wrapped while the counter runs; the region runs with the counter's function mode
and global module hooks set aside (dynamo would trace them into the graph: they are testing code), its
outputs' autograd nodes tagged as the model's, so the compiled backward's kernels count as the model's too.
"""

from __future__ import annotations

import ast
import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\((\[[^\]]*\])", re.M)
_COPY_WORDS = {"", "to", "copy", "clone", "unsafe", "view", "expand", "permute", "transpose", "unsqueeze",
               "squeeze", "t", "select", "slice", "cat", "contiguous", "reshape", "alias"}  # fmt: skip


def kernel_category(name: str, copies: str, pointwise: str) -> str:
    """A generated kernel's category by the aten ops its name lists (``cpp_fused__to_copy_clone_3``)."""
    ops = re.sub(r"^(cpp|triton_[a-z]+)_fused_|_\d+$", "", name)
    return copies if set(ops.split("_")) <= _COPY_WORDS else pointwise


def _signatures(module: Any) -> dict[str, list[str]]:
    """Kernel name -> its C argument types, from the generated module's source (``cpp_pybinding([...])``)."""
    try:
        with open(module.__file__) as source:
            text = source.read()
    except (OSError, TypeError, AttributeError):
        return {}
    return {m.group(1): ast.literal_eval(m.group(2)) for m in _KERNEL.finditer(text)}


class RegionCounting:
    """``with RegionCounting(counter, tags, tag_nodes):`` the counter (a ``KernelCounter``) counts compiled
    regions as what they launch; ``tags``: region context ("model", "head") -> the counter's context tag,
    ``tag_nodes(nodes, tag)`` tags autograd nodes."""

    def __init__(self, counter: Any, tags: dict[str, tuple], tag_nodes: Callable[..., None]) -> None:
        self.counter, self.tags, self.tag_nodes = counter, tags, tag_nodes
        self._wrapped: list[tuple[Any, str, Any]] = []  # (module, name, original kernel)
        self._seen: set[int] = set()

    def __enter__(self) -> RegionCounting:
        self._stack = contextlib.ExitStack()
        try:
            from coati_kto.models import compile as regions
        except ImportError:  # a baseline revision without model.compile (benchmarks/counts.py)
            return self
        regions.REGION_HOOKS.append(self.around)
        self._stack.callback(regions.REGION_HOOKS.remove, self.around)
        self._stack.callback(self._unwrap)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ---- the generated kernels ------------------------------------------------------------------------------
    def wrap_new_modules(self) -> None:
        """Wrap the kernels of every generated module loaded since the last call (forward and backward)."""
        from torch._inductor.codecache import PyCodeCache

        for module in list(PyCodeCache.modules):
            if id(module) in self._seen:
                continue
            self._seen.add(id(module))
            for name, types in _signatures(module).items():
                kernel = getattr(module, name, None)
                if callable(kernel):
                    self._wrapped.append((module, name, kernel))
                    setattr(module, name, self._counted(name, kernel, types))

    def _unwrap(self) -> None:
        for module, name, kernel in reversed(self._wrapped):
            setattr(module, name, kernel)
        self._wrapped.clear()

    def _counted(self, name: str, kernel: Callable[..., Any], types: list[str]) -> Callable[..., Any]:
        record = self.counter.record_kernel

        def counted(*args: Any, **kwargs: Any) -> Any:
            read = written = 0
            for arg, kind in zip(args, types, strict=False):
                if isinstance(arg, torch.Tensor):
                    size = arg.numel() * arg.element_size()
                    read, written = (
                        (read + size, written) if kind.startswith("const") else (read, written + size)
                    )
            record(name, read, written)
            return kernel(*args, **kwargs)

        return counted

    # ---- the region call ------------------------------------------------------------------------------------
    def around(self, region: Any, args: tuple, kwargs: dict) -> Any:
        """Run one compiled region call (a ``CompiledForward``), counted (``coati_kto.models.compile``)."""
        counter, tag, compiled = self.counter, self.tags[region.context], region.compiled
        if region.context == "model" and counter.tally.passes:
            counter.tally.passes[-1].append("compiled")
        counter._current.append(tag)
        counter.in_region += 1
        try:
            with _python_hooks_set_aside(counter), _modes_ignore_compile_internals():
                self.wrap_new_modules()
                out = compiled(*args, **kwargs)
            self.wrap_new_modules()
        finally:
            counter.in_region -= 1
            counter._current.pop()
        if torch.is_grad_enabled():
            leaves = torch.utils._pytree.tree_leaves(out)
            nodes = [
                t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf
            ]
            self.tag_nodes(nodes, tag)
        return out


@contextlib.contextmanager
def _python_hooks_set_aside(counter: Any) -> Iterator[None]:
    """The counter's function mode off the stack and its global module hooks out of torch's dicts."""
    from torch.nn.modules import module as nn_module
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    dicts = (
        nn_module._global_forward_pre_hooks,
        nn_module._global_forward_hooks,
        nn_module._global_forward_hooks_always_called,
    )
    saved = [{k: d.pop(k) for k in counter.hook_ids if k in d} for d in dicts]
    stack = _get_current_function_mode_stack()
    ours = bool(stack) and getattr(stack[-1], "counter", None) is counter
    try:
        with _pop_mode_temporarily() if ours else contextlib.nullcontext():
            yield
    finally:
        for d, items in zip(dicts, saved, strict=True):
            d.update(items)


@contextlib.contextmanager
def _modes_ignore_compile_internals() -> Iterator[None]:
    """Inside a region the counter's dispatch mode lets dynamo run compiled code (the flag its ``__enter__``
    set from ``ignore_compile_internals``, False outside regions so that other compiles stay eager under it)."""
    from torch._C._dynamo.guards import set_is_in_mode_without_ignore_compile_internals
    from torch.utils import _python_dispatch as dispatch

    was = dispatch._is_in_any_mode_without_ignore_compile_internals
    dispatch._is_in_any_mode_without_ignore_compile_internals = False
    set_is_in_mode_without_ignore_compile_internals(False)
    try:
        yield
    finally:
        dispatch._is_in_any_mode_without_ignore_compile_internals = was
        set_is_in_mode_without_ignore_compile_internals(was)
