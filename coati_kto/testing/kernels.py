"""What a piece of code would cost a GPU, counted on any device: kernels, the bytes they read and write, per
category, host syncs (coati_kto.testing.syncs) and the attention path each model pass took.

Every aten op on tensors is one kernel (a ``_foreach_``/``_fused_`` op: the launches CUDA's multi-tensor apply
makes), except views, metadata and allocations (an op whose result aliases its input, ``empty``...). Bytes read:
the tensor inputs' sizes (a broadcast input counts its memory, not its expanded size; a gather counts its
indices and what it gathers, not the whole table); bytes written: the outputs' (or the mutated arguments').
The same ops run on a CPU as on a GPU (the project's AdamW is torch's fused kernel on both).

Categories need context, not op names alone: where in the code an op runs (innermost first: torch.optim and
ColossalAI's optimizer step, the gradient norm, ZeRO's gradient hooks and buckets, the KTO loss, the chunked LM
head and log-softmax, the attention masks) and, inside a model, which module (global module hooks: an
``*Attention`` module, a ``Linear``) and which op (matmuls, attention kernels, casts and copies, the rest:
norms / rotary / activations / embedding). A backward op takes the category of the forward op whose autograd
node runs it (tagged at the forward, in the node's metadata). Work of the data pipeline (``coati_kto/data``,
``torch.utils.data``) is host work: not counted.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from coati_kto.testing import attention_paths as paths
from coati_kto.testing.compiled import RegionCounting, kernel_category
from coati_kto.testing.op_cost import op_cost
from coati_kto.testing.syncs import SyncRecord, counting_synchronize, dispatch_sync, function_sync

try:
    from coati_kto.models.logprobs import accelerator_chunks
except ImportError:  # a revision from before GPU-sized head chunks (benchmarks/counts.py's before column)
    accelerator_chunks = contextlib.nullcontext

MATMUL, ATTENTION, POINTWISE, COPIES = (
    "model matmuls",
    "attention",
    "norms / rotary / activations",
    "casts and copies",
)
HEAD, LOSS, GRADS, NORM, OPTIMIZER, OTHER = (
    "LM head and log-softmax",
    "loss",
    "gradient buckets and reductions",
    "gradient norm",
    "optimizer",
    "other",
)
CATEGORIES = (MATMUL, ATTENTION, POINTWISE, COPIES, HEAD, LOSS, GRADS, NORM, OPTIMIZER, OTHER)
GRAD_PATH = (GRADS, NORM, OPTIMIZER)  # the optimizer and gradient path of the target
MODEL, HOST = "model", "host"  # contexts refined by op (MODEL) or not counted (HOST)

_aten = torch.ops.aten
_MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm"}
_SOFTMAX_OPS = {"_softmax", "softmax", "_softmax_backward_data", "_safe_softmax"}
_ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
_COPY_OPS = {"_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "contiguous"}
# (part of a file path, function name or None) -> context; the innermost frame that matches decides.
_PLACES: tuple[tuple[str, str | None, str], ...] = (
    ("/torch/utils/data/", None, HOST),
    ("coati_kto/data/packed", "pad_columns", ATTENTION),  # flex's block padding, on the device in a pass
    ("coati_kto/data/", None, HOST),
    ("/torch/autograd/__init__", "_make_grads", LOSS),  # the backward's seed (a ones_like of the loss)
    ("/torch/optim/", None, OPTIMIZER),
    ("coati_kto/parallel/optimizer_path", None, OPTIMIZER),
    ("coati_kto/parallel/mixed_adamw", None, OPTIMIZER),
    ("/colossalai/nn/optimizer/", None, OPTIMIZER),
    ("/torch/nn/utils/clip_grad", None, NORM),
    ("coati_kto/parallel/grad_norm", None, NORM),
    ("/colossalai/", "_compute_grad_norm", NORM),
    ("/colossalai/", "step", OPTIMIZER),
    ("/colossalai/zero/", None, GRADS),
    ("/colossalai/amp/", None, OPTIMIZER),
    ("coati_kto/models/packing", "allowed_attention", ATTENTION),
    ("coati_kto/models/packing", "_additive_mask", ATTENTION),
    ("coati_kto/models/packing", "_flex_mask", ATTENTION),
    ("coati_kto/models/packing", "build", ATTENTION),
    ("/transformers/masking", None, ATTENTION),
    ("/transformers/", None, MODEL),
    ("/peft/", None, MODEL),
    ("/colossalai/shardformer/", None, MODEL),
    ("coati_kto/families/", None, MODEL),
    ("coati_kto/models/norms", None, MODEL),
    ("/torch/nn/modules/", None, MODEL),
    ("coati_kto/trainer/loss", None, LOSS),
    ("coati_kto/models/logprobs", None, HEAD),
    ("coati_kto/models/packing", "score", HEAD),
    ("coati_kto/models/lm_head", None, HEAD),
)
# compiled regions' contexts (coati_kto.parallel.compiled)
_REGION_TAGS = {
    "model": (MODEL, False, False),
    "head": (HEAD, False, False),
    "optimizer": (OPTIMIZER, False, False),
}
_BACKWARD = {"backward", "grad"}  # Tensor.backward, torch.autograd.backward / grad
_place_cache: dict[Any, str | None] = {}


def _place_of(code: Any) -> str | None:
    if code not in _place_cache:
        name, path = code.co_name, code.co_filename.replace("\\", "/")
        _place_cache[code] = next(
            (ctx for part, fn, ctx in _PLACES if part in path and (fn is None or fn == name)), None
        )
    return _place_cache[code]


def code_context() -> str:
    """The context of the calling code: the innermost frame :data:`_PLACES` names, else OTHER."""
    frame = sys._getframe(1)
    while frame is not None:
        ctx = _place_of(frame.f_code)
        if ctx is not None:
            return ctx
        frame = frame.f_back
    return OTHER


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def model_category(op_name: str, in_attention: bool, in_linear: bool) -> str:
    """A model op's category by what it is and where (module context)."""
    if op_name.startswith(_ATTENTION_OPS) or "flex_attention" in op_name:
        return ATTENTION
    if op_name in _MATMUL_OPS:
        return ATTENTION if in_attention and not in_linear else MATMUL
    if op_name in _SOFTMAX_OPS and in_attention:
        return ATTENTION
    if op_name in _COPY_OPS:
        return COPIES
    return POINTWISE


@dataclass
class Tally:
    """Per category: kernels, bytes read, bytes written; syncs (coati_kto.testing.syncs.SyncRecord); the
    attention path of each model pass, in order."""

    kernels: Counter = field(default_factory=Counter)
    read: Counter = field(default_factory=Counter)
    written: Counter = field(default_factory=Counter)
    syncs: SyncRecord = field(default_factory=SyncRecord)
    passes: list[list[str]] = field(default_factory=list)

    def summary(self, params: int) -> dict[str, Any]:
        """Plain numbers: per category kernels and bytes per parameter (read + written), totals, syncs."""
        cats = {
            c: {"kernels": self.kernels[c], "bytes_per_param": (self.read[c] + self.written[c]) / params}
            for c in CATEGORIES
        }
        non_matmul = sum(v["bytes_per_param"] for c, v in cats.items() if c != MATMUL)
        return {
            "categories": cats,
            "kernels": sum(self.kernels.values()),
            "bytes_per_param": sum(v["bytes_per_param"] for v in cats.values()),
            "non_matmul_bytes_per_param": non_matmul,
            "grad_path_bytes_per_param": sum(cats[c]["bytes_per_param"] for c in GRAD_PATH),
            "syncs": self.syncs.total,
            "syncs_by_op": dict(self.syncs.by_op),
            "syncs_by_place": dict(self.syncs.by_place),
            "attention": [_path_summary(p) for p in self.passes],
        }


def _path_summary(paths: list[str]) -> str:
    return ", ".join(f"{p} x{n}" for p, n in Counter(paths).items()) or "none"


class KernelCounter(Tally):
    """``with KernelCounter() as count: ...``; then :meth:`Tally.summary` (per parameter of ``params``).
    ``steps=True``: a new :class:`Tally` starts at the end of every optimizer step (torch's global step hook,
    which every plugin's inner optimizer runs), kept in ``count.windows``: window i is step i's cycle (the
    previous step's end to this one's), windows after the first are steady state."""

    def __init__(self, steps: bool = False, log: bool = False) -> None:
        super().__init__()
        self.log: list[tuple[str, str, int, int, int]] | None = [] if log else None  # op, category, k, r, w
        self.windows: list[Tally] = []
        self._steps = steps
        self._modules: list[torch.nn.Module] = []
        self._current: list[str] = []  # the context of the torch-level call being run (a stack)

    @property
    def tally(self) -> Tally:
        return self.windows[-1] if self.windows else self

    def __enter__(self) -> KernelCounter:
        from torch.nn.modules import module as nn_module

        self._stack = contextlib.ExitStack()
        self._stack.enter_context(counting_synchronize(self._sync))
        hooks = (
            nn_module.register_module_forward_pre_hook(self._enter_module),
            nn_module.register_module_forward_hook(self._leave_module, always_call=True),
        )
        # Set aside inside compiled regions (coati_kto.testing.compiled), which count in_region
        self.hook_ids, self.in_region = {h.id for h in hooks}, 0
        self._stack.callback(lambda: [h.remove() for h in hooks])
        if self._steps:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            hook = register_optimizer_step_post_hook(lambda *_: self.windows.append(Tally()))
            self._stack.callback(hook.remove)
        self._stack.enter_context(paths.flex_uncompiled())
        self._stack.enter_context(accelerator_chunks())  # a GPU's LM-head chunks, not the CPU's smaller ones
        self._stack.enter_context(_Functions(self))
        self._stack.enter_context(_Dispatch(self))
        self._stack.enter_context(RegionCounting(self, _REGION_TAGS, _tag_new_nodes))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ---- context ----------------------------------------------------------------------------------------
    def _enter_module(self, module: torch.nn.Module, _: Any) -> None:
        if not self._modules and not isinstance(module, torch.fx.GraphModule):  # FX: flex's backward, no pass
            self.tally.passes.append([])
        self._modules.append(module)

    def _leave_module(self, module: torch.nn.Module, *_: Any) -> None:
        if self._modules and self._modules[-1] is module:
            self._modules.pop()

    def _module_flags(self) -> tuple[bool, bool]:
        attention = any(type(m).__name__.endswith("Attention") for m in self._modules)
        return attention, any(isinstance(m, torch.nn.Linear) for m in self._modules)

    def _sync(self, kind: str) -> None:
        if code_context() != HOST:  # the data pipeline's reads are of host tensors
            self.tally.syncs.add(kind)

    def context(self) -> tuple[str, bool, bool]:
        """(context, in attention module, in linear module) of the op being dispatched now."""
        if self._current and self._current[-1] is not None:
            return self._current[-1]
        node = torch._C._current_autograd_node()
        if node is not None:
            tag = node.metadata.get("coati_kto_context")
            if tag is not None:
                return tag
            if "AccumulateGrad" in node.name():
                return GRADS, False, False
        ctx = code_context()
        return (ctx, *self._module_flags()) if ctx == MODEL else (ctx, False, False)

    def record_higher_order(self, func: Any, args: tuple, out: Any) -> None:
        """A higher-order operator (FlexAttention): one attention kernel reading its tensor arguments."""
        if (path := paths.higher_order_path(func)) is not None and self.tally.passes:
            self.tally.passes[-1].append(path)
        self._add(str(func), ATTENTION, 1, paths.tensor_bytes(args), paths.tensor_bytes(out))

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        kind = dispatch_sync(func, args)
        if kind is not None:
            self._sync(kind)
        ctx = (GRADS, False, False) if func.namespace == "c10d" else self.context()
        if ctx[0] == HOST:
            return
        kernels, read, written = op_cost(func, args, kwargs, out)
        if not kernels:
            return
        name = func.overloadpacket.__name__
        category = model_category(name, ctx[1], ctx[2]) if ctx[0] == MODEL else ctx[0]
        if category == ATTENTION and name == "_softmax" and self._modules and self.tally.passes:
            self.tally.passes[-1].append(paths.EAGER)  # a softmax in an attention module: no fused kernel
        self._add(str(func), category, kernels, read, written)

    def record_kernel(self, name: str, read: int, written: int) -> None:
        """One kernel that torch.compile generated (coati_kto.testing.compiled), in the current context."""
        ctx = self.context()
        if ctx[0] != HOST:
            category = kernel_category(name, COPIES, POINTWISE) if ctx[0] == MODEL else ctx[0]
            self._add(name, category, 1, read, written)

    def _add(self, op: str, category: str, kernels: int, read: int, written: int) -> None:
        if self.log is not None:
            self.log.append((op, category, kernels, read, written))
        tally = self.tally
        tally.kernels[category] += kernels
        tally.read[category] += read
        tally.written[category] += written


class _Functions(TorchFunctionMode):
    """Sets the context of each torch-level call and tags the autograd nodes it creates with it."""

    def __init__(self, counter: KernelCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        counter = self.counter
        kind = function_sync(func, args, kwargs)
        if kind is not None:
            counter._sync(kind)
        path = paths.function_path(func, args, kwargs)
        if path is not None and counter.tally.passes:
            counter.tally.passes[-1].append(path)
        ctx = code_context()
        tag = (ctx, *counter._module_flags()) if ctx == MODEL else (ctx, False, False)
        # A backward's ops take their autograd node's context (None: look at the node)
        counter._current.append(None if getattr(func, "__name__", "") in _BACKWARD else tag)
        try:
            out = func(*args, **kwargs)
        finally:
            counter._current.pop()
        if torch.is_grad_enabled():
            _tag_new_nodes([t.grad_fn for t in _tensors(out) if t.requires_grad and not t.is_leaf], tag)
        return out


def _tag_new_nodes(nodes: list[Any], tag: tuple[str, bool, bool]) -> None:
    """Tag the autograd nodes one call created (a composite makes several: matmul's view, mm, view) with its
    context: from its outputs' nodes back to the first node an earlier call tagged (or a leaf's)."""
    while nodes:
        node = nodes.pop()
        if node is None or "coati_kto_context" in node.metadata or "AccumulateGrad" in node.name():
            continue
        node.metadata["coati_kto_context"] = tag
        nodes.extend(next_node for next_node, _ in node.next_functions)


class _Dispatch(TorchDispatchMode):
    # FlexAttention's forward and backward: higher-order operators, run as they are and counted whole.
    supports_higher_order_operators = True

    def ignore_compile_internals(self) -> bool:  # type: ignore[override]
        # Inside a compiled region (coati_kto.testing.compiled) dynamo runs it compiled under the counter (its
        # fake-tensor tracing is skipped); elsewhere (flex's own compile) dynamo leaves code eager, as before.
        return self.counter.in_region > 0

    def __init__(self, counter: KernelCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if paths.is_higher_order(func):
            self.counter.record_higher_order(func, args, out)
        else:
            self.counter.record(func, args, kwargs, out)
        return out
