"""Bytes per rank of a KTO run: weights, gradients, optimizer states, the reference, activations and buffers.

The arithmetic of ``coati-kto plan`` and of the predicted peak ``train`` prints. It follows what the project
trains with:

- The policy works in the plugin's precision (bf16 / fp16: 2 bytes; fp32: 4). Gradients are in that dtype.
- AdamW's two moments are fp32 (8 bytes per trainable parameter; ``train.optimizer_state_dtype: bf16``: 4).
  Under bf16 / fp16 the optimizer updates fp32 masters (4 bytes): ZeRO's optimizer (stage 1 and 2) and the AMP
  optimizer (hybrid_parallel at ZeRO 0, which one data-parallel rank runs) both keep them. At its step each
  casts the working gradients it updates to fp32 (4 bytes, alive through the step).
- ZeRO 1 and 2 shard the masters and moments over the data-parallel ranks, ZeRO 2 also the gradients;
  ``plugin.cpu_offload`` keeps masters and moments in host memory (counted apart). Tensor parallelism splits
  everything the model's projections and vocabulary hold (``coati_kto.parallel.model_shape``).
- Communication: torch DDP (ddp, and hybrid_parallel at ZeRO 0 on more than one data-parallel rank) keeps
  buckets as large as the gradients; ZeRO a reduce bucket and its reduce-scatter output (12M elements each).
- The reference (``kto.reference: online``) is a second copy of the weights in the working dtype, split as the
  policy is; cached: nothing; under LoRA it is the policy with the adapters off: nothing more.
- Activations: :mod:`coati_kto.parallel.activations`.

The peak of a step is the static part (weights, masters and moments, reference, buffers) plus the largest of
what comes and goes: the gradient pass's activations (with the accumulated gradients when micro-batches
accumulate), and at the step the gradients and their fp32 copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coati_kto.parallel.activations import Workload, activation_bytes
from coati_kto.parallel.model_shape import ModelShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ZERO_BUCKET_ELEMENTS = 12 * 1024 * 1024  # the plugins' reduce_bucket_size_in_m / zero_bucket_size_in_m: 12
GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    """A parallel layout: the plugin, its precision, ZeRO stage (the one that runs), and the axes' sizes."""

    plugin: str
    precision: str
    zero_stage: int
    tp: int = 1
    dp: int = 1
    sp: int = 1
    cpu_offload: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.sp

    @property
    def torch_ddp(self) -> bool:
        """Whether torch DDP wraps the policy (its buckets): ddp and ZeRO 0, on more than one data-parallel rank."""
        return self.zero_stage == 0 and self.dp * self.sp > 1

    def describe(self) -> str:
        axes = f"tp {self.tp}" + (f" x sp {self.sp}" if self.sp > 1 else "") + f" x dp {self.dp}"
        offload = ", cpu_offload" if self.cpu_offload else ""
        return f"{self.plugin} {self.precision}, {axes}, ZeRO-{self.zero_stage}{offload}"


@dataclass
class MemoryPlan:
    """Bytes per rank by part; ``peak`` is the predicted most alive at once during a step."""

    layout: Layout
    params: int  # per tensor-parallel rank
    trainable: int  # per tensor-parallel rank
    weights: int
    gradients: int
    masters: int
    moments: int
    step_copies: int  # fp32 copies of the gradients at the optimizer step
    reference: int
    activations: int
    head: int
    communication: int
    host: int  # what cpu_offload keeps in host memory
    notes: list[str] = field(default_factory=list)
    accumulating: bool = False  # micro-batches accumulate: the gradients live through the next gradient pass

    @property
    def static(self) -> int:
        """Alive through the whole step."""
        return self.weights + self.masters + self.moments + self.reference + self.communication

    @property
    def peak(self) -> int:
        accumulated = self.gradients if self.accumulating else 0
        backward = self.activations + self.head + accumulated
        return self.static + max(backward, self.gradients + self.step_copies)


def plan_memory(shape: ModelShape, layout: Layout, work: Workload) -> MemoryPlan:
    """The bytes per rank of training ``shape`` on ``layout`` with ``work`` (module docstring)."""
    params = shape.params_per_rank(layout.tp)
    trainable = shape.lora_params(work.lora_rank, work.lora_targets) if work.lora_rank else params
    working = DTYPE_BYTES[layout.precision]
    mixed = layout.precision != "fp32"
    shards = layout.dp * layout.sp if layout.zero_stage >= 1 else 1  # ZeRO's group: data x sequence ranks
    owned = -(-trainable // shards)  # this rank's share of masters and moments
    moment_bytes = 4 if work.state_dtype == "bf16" else 8
    masters = 4 * owned if mixed else 0
    moments = moment_bytes * owned
    host = 0
    if layout.cpu_offload and layout.zero_stage >= 1:
        host, masters, moments = masters + moments, 0, 0
    grads = working * (-(-trainable // shards) if layout.zero_stage == 2 else trainable)
    step_copies = 4 * owned if mixed else 0
    reference = working * params if work.reference == "online" and not work.lora_rank else 0
    comm = _communication(layout, trainable, working)
    activations, head, notes = activation_bytes(shape, layout.tp, layout.sp, working, work)
    return MemoryPlan(
        layout=layout, params=params, trainable=trainable, weights=working * params, gradients=grads,
        masters=masters, moments=moments, step_copies=step_copies, reference=reference,
        activations=activations, head=head, communication=comm, host=host, notes=notes,
        accumulating=work.accumulation_steps > 1,
    )  # fmt: skip


def _communication(layout: Layout, trainable: int, working: int) -> int:
    """Buffers the gradient reduction keeps: DDP's buckets (the gradients' size), ZeRO's bucket and the
    reduce-scatter output; nothing on one data-parallel rank."""
    if layout.dp * layout.sp == 1:
        return 0
    if layout.torch_ddp:
        return working * trainable
    return 2 * working * min(trainable, ZERO_BUCKET_ELEMENTS)
