"""Bytes per rank of a KTO run: weights, gradients, optimizer states, the reference, activations and buffers.

The arithmetic of ``coati-kto plan`` and of the predicted peak ``train`` prints. It follows what the project
trains with:

- The policy works in the plugin's precision (bf16 / fp16: 2 bytes; fp32: 4). Gradients are in that dtype.
- AdamW's two moments are fp32 (8 bytes per trainable parameter; ``train.optimizer_state_dtype: bf16``: 4).
  Under bf16 / fp16 the optimizer updates fp32 masters (4 bytes): ZeRO's optimizer (stage 1 and 2) and the AMP
  optimizer (hybrid_parallel at ZeRO 0, which one data-parallel rank runs) both keep them. ZeRO keeps its fp32
  copy of its share under fp32 too (low_level_zero: ColossalAI clones the shard it steps). At its step each
  casts the working gradients it updates to fp32 (4 bytes, alive through the step); ``train.fused_optimizer``
  casts none (``_step_copies``).
- What trains: every parameter but a vision-language model's vision tower and projector (frozen unless
  ``model.train_vision``), or the LoRA adapters of the decoder's layers.
- ZeRO 1 and 2 shard the masters and moments over the data-parallel ranks, ZeRO 2 also the gradients;
  ``plugin.cpu_offload`` keeps masters, moments and the step's fp32 gradients in host memory (counted apart).
  Tensor parallelism splits everything the model's projections and vocabulary hold
  (``coati_kto.parallel.model_shape``).
- Communication: torch DDP (ddp, and hybrid_parallel at ZeRO 0 on more than one data-parallel rank) keeps
  buckets as large as the gradients; ZeRO a reduce bucket and its reduce-scatter output (12M elements each).
- The reference (``kto.reference: online``) is a second copy of the weights in the working dtype (of
  ``model.reference_path``'s model where set), split as the policy is; cached: nothing; under LoRA it is the
  policy with the adapters off: nothing more.
- Activations: :mod:`coati_kto.parallel.activations`.
- Pipeline parallelism (``pp`` stages, :mod:`coati_kto.parallel.stages`): every part above is the stage's. A
  stage holds its layers, the first also the embedding, the last the final norm and the LM head; the plan is the
  stage with the highest peak (``MemoryPlan.stage``). Its activations are its layers' for the micro-batches it
  keeps in flight; the last stage's head runs one micro-batch at a time. The online reference runs through the
  same stages forward-only (no gradient pass to keep activations for): its weights, split as the policy's.
  There is no torch DDP under pp (ColossalAI all-reduces each gradient in place at ZeRO 0). The schedule keeps
  hidden states [mb, S, H] in the working dtype besides the layers' activations (``p2p``, part of the gradient
  pass): each in-flight forward's output and received input, and the gradient received for a backward
  (:func:`coati_kto.parallel.stages.held_hidden`; an input the first layer keeps anyway, under checkpointing, a
  fused norm or fp32, is its activations'). The stages run padded rows (the config's padding-free rows are turned
  off under pp): no packed mask, sdpa's padding masks instead (:mod:`coati_kto.parallel.activations`).

The peak of a step is the static part (weights, masters and moments, reference, communication buffers) plus the
largest of what comes and goes: the gradient pass's activations and p2p hidden states (with the accumulated
gradients when micro-batches accumulate), and at the step the gradients and their fp32 copies. The gradients exist from the step's first
backward on: a stage whose warm-up runs every forward of the step (1F1B's stage 0 at pp micro-batches) holds
them with one micro-batch fewer in flight (``MemoryPlan.passes``; measured, docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from coati_kto.parallel.activations import Workload, activation_bytes
from coati_kto.parallel.model_shape import ModelShape
from coati_kto.parallel.stages import held_hidden, in_flight, kept_hidden, stage_chunks

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
    pp: int = 1
    pp_style: str = "1f1b"
    chunks: int = 1  # model chunks per stage (interleaved)

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.sp * self.pp

    @property
    def torch_ddp(self) -> bool:
        """Whether torch DDP wraps the policy (its buckets): ZeRO 0 on more than one data-parallel rank, without
        pipeline stages (ColossalAI builds no DDP under pp)."""
        return self.zero_stage == 0 and self.dp * self.sp > 1 and self.pp == 1

    def describe(self) -> str:
        pp = ""
        if self.pp > 1:
            style = f" interleaved x {self.chunks} chunks" if self.pp_style == "interleaved" else " 1f1b"
            pp = f" x pp {self.pp}{style}"
        axes = f"tp {self.tp}" + (f" x sp {self.sp}" if self.sp > 1 else "") + pp + f" x dp {self.dp}"
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
    step_copies: int  # what the optimizer step makes of the gradients on the device (_step_copies)
    reference: int
    activations: int
    head: int
    communication: int
    host: int  # what cpu_offload keeps in host memory: masters, moments, the step's fp32 gradients
    notes: list[str] = field(default_factory=list)
    accumulating: bool = False  # micro-batches accumulate: the gradients live through the next gradient pass
    p2p: int = 0  # the hidden states a pipeline stage's schedule holds at once (sent, received, gradients)
    stage: int = 0  # the pipeline stage this plan is of (the one with the highest peak)
    stage_layers: int = 0  # the decoder layers that stage holds
    in_flight: int = 1  # the micro-batches (chunk forwards, interleaved) whose activations it keeps at once
    forwards: int = 1  # the micro-batches (chunk forwards) a step runs through this stage
    per_forward: int = 0  # the activations (and p2p hidden states) one of them keeps while in flight

    @property
    def static(self) -> int:
        """Alive through the whole step."""
        return self.weights + self.masters + self.moments + self.reference + self.communication

    @property
    def passes(self) -> int:
        """The most the gradient passes hold at once: activations in flight (and a pipeline stage's p2p hidden
        states), the head, and the gradients the step's backwards accumulated so far. Those exist from the first
        backward on. When every forward of the step is in flight before it (a pipeline stage whose warm-up takes
        them all: ``forwards == in_flight``), they meet at most one forward fewer."""
        passes = self.activations + self.head + self.p2p
        if not self.accumulating:
            return passes
        if self.forwards > self.in_flight:
            return passes + self.gradients
        return max(passes, passes - self.per_forward + self.gradients)

    @property
    def peak(self) -> int:
        return self.static + max(self.passes, self.gradients + self.step_copies)


def plan_memory(shape: ModelShape, layout: Layout, work: Workload) -> MemoryPlan:
    """The bytes per rank of training ``shape`` on ``layout`` with ``work`` (module docstring): under pipeline
    parallelism, of the stage with the highest peak (the first of equals)."""
    return max(plan_stages(shape, layout, work), key=lambda plan: (plan.peak, -plan.stage))


def plan_stages(shape: ModelShape, layout: Layout, work: Workload) -> list[MemoryPlan]:
    """The plan of each pipeline stage, stage 0 first (one plan when ``layout.pp`` is 1)."""
    if layout.pp == 1:
        return [_plan_stage(shape, layout, work, 0)]
    # The stages run padded rows: no packed rows and no packed mask, sdpa's padding masks instead.
    padded = work.padded_mask or (work.dense_mask and not work.eager_attention)
    work = dataclasses.replace(work, dense_mask=False, padded_mask=padded)
    return [_plan_stage(shape, layout, work, stage) for stage in range(layout.pp)]


def _plan_stage(shape: ModelShape, layout: Layout, work: Workload, stage: int) -> MemoryPlan:
    """The plan of one pipeline stage (the whole model when ``layout.pp`` is 1)."""
    first, last = stage == 0, stage == layout.pp - 1
    chunks = stage_chunks(shape.layers, layout.pp, layout.chunks, stage)
    layers = sum(chunks)
    params = _rank_params(shape, layout, layers, first, last)
    trainable = _trained(shape, work, params, layers, first)
    working = DTYPE_BYTES[layout.precision]
    mixed = layout.precision != "fp32"
    shards = layout.dp * layout.sp if layout.zero_stage >= 1 else 1  # ZeRO's group: data x sequence ranks
    owned = -(-trainable // shards)  # this rank's share of masters and moments
    moment_bytes = 4 if work.state_dtype == "bf16" else 8
    masters = 4 * owned if mixed or layout.zero_stage >= 1 else 0  # fp32 ZeRO: a clone of the share
    moments = moment_bytes * owned
    step_copies, host_copies = _step_copies(layout, work, owned)
    host = 0
    if layout.cpu_offload and layout.zero_stage >= 1:
        host, masters, moments = masters + moments + host_copies, 0, 0
    grads = working * (-(-trainable // shards) if layout.zero_stage == 2 else trainable)
    reference = (
        working * _reference_params(work, layout, stage, params) if _reads_reference(work, True) else 0
    )
    comm = _communication(layout, trainable, working)
    alive = (
        in_flight(stage, layout.pp, work.accumulation_steps, layout.pp_style, layout.chunks)
        if layout.pp > 1
        else 1
    )
    held = max(chunks) if layout.pp > 1 else layers  # activations of one chunk forward: its layers
    activations, head, notes = activation_bytes(shape, layout.tp, layout.sp, working, work, held, alive, last)
    fewer = activation_bytes(shape, layout.tp, layout.sp, working, work, held, alive - 1, last)[0]
    p2p, p2p_share = _p2p_bytes(shape, layout, work, stage)
    return MemoryPlan(
        layout=layout, params=params, trainable=trainable, weights=working * params, gradients=grads,
        masters=masters, moments=moments, step_copies=step_copies, reference=reference,
        activations=activations, head=head, communication=comm, host=host, notes=notes,
        accumulating=work.accumulation_steps > 1, p2p=p2p, stage=stage, stage_layers=layers, in_flight=alive,
        forwards=work.accumulation_steps * layout.chunks, per_forward=activations - fewer + p2p_share,
    )  # fmt: skip


def _rank_params(shape: ModelShape, layout: Layout, layers: int, first: bool, last: bool) -> int:
    """The parameters one rank of a stage of ``layers`` decoder layers holds (the whole model's share at pp 1)."""
    if layout.pp > 1:
        return shape.stage_params(layout.tp, layers, first, last)
    return shape.params_per_rank(layout.tp)


def _reference_params(work: Workload, layout: Layout, stage: int, params: int) -> int:
    """The online reference's parameters on one rank of ``stage``: the policy's ``params``, or where
    ``model.reference_path`` names another model its own share, split and staged as the policy's."""
    ref = work.reference_shape
    if ref is None:
        return params
    layers = sum(stage_chunks(ref.layers, layout.pp, layout.chunks, stage))
    return _rank_params(ref, layout, layers, stage == 0, stage == layout.pp - 1)


def _reads_reference(work: Workload, online_only: bool = False) -> bool:
    """Whether a reference model is loaded beside the policy: not under LoRA (the policy with its adapters
    off); with ``online_only`` not for ``kto.reference: cached`` (read only to compute the cache)."""
    return not work.lora_rank and (work.reference == "online" or not online_only)


def _trained(shape: ModelShape, work: Workload, params: int, layers: int, first: bool) -> int:
    """Of a stage's ``params`` (``layers`` decoder layers, ``first``: the first stage), those the optimizer
    updates: the LoRA adapters of its layers; else all but a vision tower it holds, frozen unless
    ``model.train_vision`` (``coati_kto.models.hf.freeze_vision_tower``)."""
    if work.lora_rank:
        return shape.lora_params(work.lora_rank, work.lora_targets) * layers // shape.layers
    return params - (shape.tower_params if first and not work.train_vision else 0)


def _step_copies(layout: Layout, work: Workload, owned: int) -> tuple[int, int]:
    """(device, host) bytes of what the optimizer step makes of the ``owned`` parameters' gradients:

    - ``plugin.cpu_offload`` (ZeRO): each gradient cast to fp32 and moved to its master in host memory
      (ColossalAI's ``LowLevelZeroOptimizer.step``, fp32 runs too): 4 bytes each on the host; on the device only
      one parameter's fp32 cast at a time, not counted;
    - ``train.fused_optimizer`` (bf16, ``coati_kto.parallel.optimizer_path``): no fp32 copy; over several ZeRO
      ranks ``_fused_zero_step`` writes each update into a new working-dtype partition for the all-gather (2
      bytes each); at one ZeRO rank, and on the AMP optimizer (ZeRO 0), into the working weights themselves;
    - otherwise, bf16 / fp16: the gradients cast to fp32 on the device (4 bytes each); fp32: nothing.
    """
    zero = layout.zero_stage >= 1
    if layout.cpu_offload and zero:
        return 0, 4 * owned
    if layout.precision == "fp32":
        return 0, 0
    if work.fused_optimizer:
        several = zero and layout.dp * layout.sp > 1
        return (DTYPE_BYTES[layout.precision] * owned if several else 0), 0
    return 4 * owned, 0


def _p2p_bytes(shape: ModelShape, layout: Layout, work: Workload, stage: int) -> tuple[int, int]:
    """(the most, those of the first backward's forward) of the hidden states [mb, S, H] the schedule holds on
    ``stage`` besides its layers' activations (:func:`coati_kto.parallel.stages.held_hidden`); (0, 0) without pp.
    The received input is the first layer's own saved tensor under checkpointing, a fused norm, or fp32 (the
    norm's cast is the tensor itself); bf16 / fp16 eager norms keep an fp32 copy instead."""
    if layout.pp == 1:
        return 0, 0
    kept = work.checkpointing or work.fused_norms or layout.precision == "fp32"
    hidden = work.micro_batch * work.length * shape.hidden * DTYPE_BYTES[layout.precision]
    style, chunks = layout.pp_style, layout.chunks
    most = held_hidden(stage, layout.pp, work.accumulation_steps, style, chunks, kept)
    first = kept_hidden(stage, layout.pp, chunks - 1 if style == "interleaved" else 0, chunks, kept)
    return most * hidden, first * hidden


def _communication(layout: Layout, trainable: int, working: int) -> int:
    """Buffers the gradient reduction keeps: DDP's buckets (the gradients' size), ZeRO's bucket and the
    reduce-scatter output; nothing on one data-parallel rank, nor with pipeline stages at ZeRO 0."""
    if layout.dp * layout.sp == 1 or (layout.pp > 1 and layout.zero_stage == 0):
        return 0  # pp at ZeRO 0: ColossalAI all-reduces each gradient in place, no buckets
    if layout.torch_ddp:
        return working * trainable
    return 2 * working * min(trainable, ZERO_BUCKET_ELEMENTS)


def precompute_weight_bytes(shape: ModelShape, work: Workload, precision: str) -> int:
    """The reference weights ``coati-kto precompute`` (and ``train`` with ``kto.reference: cached`` and no cache
    yet) holds on each rank: the whole reference (``model.reference_path``'s, else ``shape``'s) in the working
    dtype. It scores without a plugin (no tp, pp or ZeRO split), so a cached run whose layout fits can still have
    a cache no one of its GPUs can compute. A lower bound: its activations at ``kto.precompute_batch_size`` come
    on top."""
    return (work.reference_shape or shape).params * DTYPE_BYTES[precision]


def load_host_bytes(
    shape: ModelShape, work: Workload, cast_rounds: bool, layout: Layout | None = None
) -> int:
    """Host memory one rank holds at its peak while it loads, before the plugin moves the policy to its GPU.

    Every rank reads each model whole into host memory in fp32 (4 bytes per parameter: no lazy or per-shard
    load). The reference (``model.reference_path``'s model, when another) is read first and placed on the GPU
    before the policy is read (``coati_kto.recipe.components``), so the two never share host memory; computing a
    cached reference reads it whole the same way. Then the plugin shards the policy (``layout``'s tensor
    parallelism and pipeline stage, hybrid_parallel's shardformer; None: one rank, no split) and casts this rank's
    share; where that rounds the checkpoint's values (``model_shape.cast_rounds``: stored in fp32) the fp32 values
    of its trained parameters stay beside the working copy for the masters (``parallel.masters``): 4 bytes per
    parameter of the share and 2 per trained one, of the stage with the most. A lower bound: the process itself
    and its data come on top; on the CPU the models stay there."""
    layout = layout or Layout("", "fp32", 0)
    read = max(shape.params, (work.reference_shape or shape).params if _reads_reference(work) else 0)
    if not cast_rounds or work.lora_rank:  # LoRA: the base weights are frozen, no masters
        return 4 * read
    return max(4 * read, _cast_peak(shape, work, layout))


def _cast_peak(shape: ModelShape, work: Workload, layout: Layout) -> int:
    """The most one rank holds as the plugin casts its share of the policy, parameter by parameter, with the fp32
    values of the trained ones kept: its fp32 share before (4 bytes per parameter), the working copy of every
    parameter beside the trained ones' fp32 values after (2 per parameter, 4 per trained one: a frozen vision
    tower's fp32 values are let go), of the pipeline stage that holds the most."""
    most = 0
    for stage in range(layout.pp):
        layers = sum(stage_chunks(shape.layers, layout.pp, layout.chunks, stage))
        params = _rank_params(shape, layout, layers, stage == 0, stage == layout.pp - 1)
        trained = _trained(shape, work, params, layers, stage == 0)
        most = max(most, 4 * params, 2 * params + 4 * trained)  # bf16 and fp16: 2 bytes
    return most
