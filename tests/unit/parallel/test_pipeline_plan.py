"""The memory plan under pipeline parallelism, number by number: ColossalAI's stage split, the parameters and
activations of each stage, and the layouts the search offers with pp (tiny Llama shapes, Llama 3.1 8B's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import PLAN_CONFIG

from coati_kto.errors import UserError
from coati_kto.parallel.activations import Workload, layer_bytes
from coati_kto.parallel.layout_search import RULE, candidates, fitting_layouts, rank, usable_bytes
from coati_kto.parallel.memory_plan import Layout, plan_memory, plan_stages
from coati_kto.parallel.model_shape import ModelShape, model_shape
from coati_kto.parallel.stages import bubble, distribute_layers, in_flight, least_microbatches, stage_chunks

REPO = Path(__file__).resolve().parents[3]

# The tiny Llama with 3 layers, by hand: embedding and head 512 x 64 each; a layer's q, k, v, o 4 x 64 x 64 and
# MLP 3 x 64 x 128 (split by tp), its two norms 2 x 64 (whole); the final norm 64.
EMBED, LAYER_SPLIT, LAYER_NORMS, FINAL_NORM = 512 * 64, 4 * 64 * 64 + 3 * 64 * 128, 2 * 64, 64
STAGE0 = EMBED + LAYER_SPLIT + LAYER_NORMS  # 1 layer + the embedding: 73,856
STAGE1 = 2 * (LAYER_SPLIT + LAYER_NORMS) + FINAL_NORM + EMBED  # 2 layers + final norm + head: 115,008


@pytest.fixture(scope="module")
def three_layers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelShape:
    """The tiny Llama's config.json with 3 layers (the meta model counts it)."""
    folder = tmp_path_factory.mktemp("three")
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**raw, "num_hidden_layers": 3, "tie_word_embeddings": False})
    )
    return model_shape(str(folder))


def test_the_stage_split_is_colossalais() -> None:
    """3 layers on 2 stages: [1, 2] (the remainder on the middle stages), as PipelineStageManager splits them."""
    from colossalai.pipeline.stage_manager import PipelineStageManager

    assert distribute_layers(3, 2) == [1, 2]
    assert distribute_layers(80, 6) == [13, 13, 14, 14, 13, 13]
    for layers, stages, chunks in [(3, 2, 1), (7, 4, 1), (80, 6, 1), (32, 3, 1), (10, 2, 2), (13, 4, 2)]:
        manager = SimpleNamespace(num_layers_per_stage=None, num_stages=stages, num_model_chunks=chunks)
        ours = distribute_layers(layers, stages, chunks)
        assert ours == PipelineStageManager.distribute_layers(manager, layers), (layers, stages, chunks)
    # chunk c of stage s is virtual stage s + c x stages: 10 layers, 2 stages x 2 chunks -> [2, 3, 3, 2]
    assert (stage_chunks(10, 2, 2, 0), stage_chunks(10, 2, 2, 1)) == ([2, 3], [3, 2])


def test_each_stage_holds_its_layers_the_embedding_first_and_the_head_last(three_layers: ModelShape) -> None:
    assert (three_layers.layers, three_layers.outer_whole_params) == (3, FINAL_NORM)
    assert three_layers.stage_params(1, 1, first=True, last=False) == STAGE0 == 73_856
    assert three_layers.stage_params(1, 2, first=False, last=True) == STAGE1 == 115_008
    assert three_layers.params == STAGE0 + STAGE1  # untied: every parameter on exactly one stage
    # tp 2: the vocabulary rows and the projections halve, the norms stay whole
    assert three_layers.stage_params(2, 2, first=False, last=True) == EMBED // 2 + LAYER_SPLIT + 2 * 128 + 64
    # a tied embedding is one tensor, held on the first stage and the last
    tied = dataclasses.replace(three_layers, vocab_params=EMBED)
    assert tied.stage_params(1, 1, first=True, last=False) == STAGE0
    assert tied.stage_params(1, 2, first=False, last=True) == STAGE1


def test_the_plan_is_the_heaviest_stage(three_layers: ModelShape) -> None:
    """pp 2, bf16, one data-parallel rank (ZeRO 0, the AMP optimizer): stage 1's 115,008 parameters."""
    work = Workload(micro_batch=2, length=8, accumulation_steps=2, device="cpu")
    plan = plan_memory(three_layers, Layout("hybrid_parallel", "bf16", 0, pp=2), work)
    assert (plan.stage, plan.stage_layers, plan.params) == (1, 2, STAGE1)
    assert (plan.weights, plan.reference, plan.gradients) == (2 * STAGE1, 2 * STAGE1, 2 * STAGE1)
    assert (plan.masters, plan.moments, plan.step_copies) == (4 * STAGE1, 8 * STAGE1, 4 * STAGE1)
    assert plan.communication == 0  # one data-parallel rank
    # the last stage's received input [2, 8, 64] in bf16 (its eager norm keeps an fp32 copy, not the input)
    assert plan.p2p == 2 * 8 * 64 * 2
    cached = plan_memory(
        three_layers,
        Layout("hybrid_parallel", "bf16", 0, pp=2),
        dataclasses.replace(work, reference="cached"),
    )
    assert cached.reference == 0
    # no torch DDP under pp: ZeRO 0 on 2 data-parallel ranks keeps no buckets; ZeRO 1 its bucket and output
    assert (
        plan_memory(three_layers, Layout("hybrid_parallel", "bf16", 0, dp=2, pp=2), work).communication == 0
    )
    zero1 = plan_memory(three_layers, Layout("hybrid_parallel", "bf16", 1, dp=2, pp=2), work)
    assert (zero1.communication, zero1.masters) == (2 * 2 * STAGE1, 4 * (STAGE1 // 2))


def test_in_flight_micro_batches_per_stage() -> None:
    """1F1B: stage s of p keeps p - s micro-batches (its warm-up forwards and one more), at most the step's m."""
    assert [in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    # interleaved, 2 stages x 2 chunks, 4 micro-batches: warm-up 2 (p - s - 1) + (chunks - 1) p, and one more
    assert [in_flight(s, 2, 4, "interleaved", 2) for s in range(2)] == [5, 3]
    assert in_flight(0, 4, 1, "interleaved", 2) == 2  # capped by the step's chunk forwards
    assert (least_microbatches(4, "1f1b", 1), least_microbatches(4, "1f1b", 6)) == (4, 6)
    assert (least_microbatches(4, "interleaved", 6), least_microbatches(1, "1f1b", 1)) == (8, 1)
    assert bubble(4, 4) == 3 / 7 and bubble(2, 4, chunks=2) == 1 / 9


def test_a_stage_keeps_its_layers_activations_for_each_micro_batch_in_flight(
    three_layers: ModelShape,
) -> None:
    """3 layers on 2 stages, 2 micro-batches of 2 x 8 tokens (16), bf16: a layer keeps 2,584 B a token, a
    backward 768 B a token (test_memory_plan's numbers). Stage 0 holds 2 micro-batches of its 1 layer, stage 1
    one of its 2 and the final norm; only stage 1 has the head."""
    per_layer, backward = layer_bytes(three_layers, 1, 1, 8, 2, eager=False) * 16, 768 * 16
    assert per_layer == 2584 * 16
    work = Workload(micro_batch=2, length=8, accumulation_steps=2, device="cpu")
    layout = Layout("hybrid_parallel", "bf16", 0, pp=2)
    from coati_kto.parallel.memory_plan import _plan_stage

    first, last = _plan_stage(three_layers, layout, work, 0), _plan_stage(three_layers, layout, work, 1)
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert first.activations == 2 * 1 * per_layer + backward
    assert first.head == 0 and first.notes[0] == "none on this stage (the last stage holds it)"
    assert last.activations == 1 * 2 * per_layer + backward + 2 * 64 * 16 * 2
    assert last.head == 16 * 64 * 2 + 4 * 16 * 512 + 2 * 4 * 16 * 512  # the chunked head, one micro-batch
    assert plan_memory(three_layers, layout, work).peak == max(first.peak, last.peak) == last.peak
    # with checkpointing each in-flight micro-batch keeps each layer's input, and one layer is recomputed
    ckpt = dataclasses.replace(work, checkpointing=True)
    assert _plan_stage(three_layers, layout, ckpt, 0).activations == 2 * 64 * 16 * 2 + per_layer + 512 * 16


def test_a_stage_whose_warm_up_takes_every_forward_meets_the_gradients_one_micro_batch_fewer(
    three_layers: ModelShape,
) -> None:
    """1F1B's stage 0 at pp 2 over 2 micro-batches runs F0 F1 B0 B1: both in flight before any gradient exists,
    then one with the gradients B0 made (98M Llama: measured 1452 MiB, predicted 1547 MiB before, 1454 MiB now;
    docs/performance.md). Stage 1 (F0 B0 F1 B1), and stage 0 over 4, hold the gradients with all in flight."""
    per_layer, backward = layer_bytes(three_layers, 1, 1, 8, 2, eager=False) * 16, 768 * 16
    layout = Layout("hybrid_parallel", "bf16", 0, pp=2)
    work = Workload(micro_batch=2, length=8, accumulation_steps=2, device="cpu")
    first, last = plan_stages(three_layers, layout, work)
    hidden = 2 * 8 * 64 * 2  # [2, 8, 64] in bf16: a micro-batch's output, kept for its backward
    assert (first.forwards, first.in_flight, first.per_forward) == (2, 2, per_layer + hidden)
    assert first.p2p == 3 * hidden  # both outputs and the gradient received for the first backward
    assert first.gradients == 2 * STAGE0 > per_layer + hidden  # one micro-batch fewer with them is the larger
    fewer = 2 * per_layer + backward + 3 * hidden - (per_layer + hidden)
    assert first.passes == fewer + 2 * STAGE0 == 205_440
    assert first.peak == first.static + max(first.passes, first.gradients + first.step_copies)
    assert (last.forwards, last.in_flight) == (2, 1)
    assert last.passes == last.activations + last.head + last.p2p + 2 * STAGE1
    four = plan_stages(three_layers, layout, dataclasses.replace(work, accumulation_steps=4))[0]
    assert four.passes == 2 * per_layer + backward + 3 * hidden + 2 * STAGE0
    # without pipeline stages nothing changes: one in flight, the gradients from the second micro-batch on
    whole = plan_memory(three_layers, Layout("hybrid_parallel", "bf16", 0), work)
    assert (whole.forwards, whole.in_flight) == (2, 1)
    assert whole.passes == whole.activations + whole.head + whole.gradients


def test_a_stage_holds_the_schedules_hidden_states_of_each_micro_batch_in_flight(
    three_layers: ModelShape,
) -> None:
    """1F1B at pp 4 over 4 micro-batches of 2 x 8 tokens; one hidden state [2, 8, 64] is 2,048 B in bf16. Stage s
    keeps the output of each of its 4 - s micro-batches in flight until that one's backward (ColossalAI's
    ``output_objs``) and receives the gradient of one for its backward; the last stage sends nothing (its output is
    the loss) and receives no gradient. The received inputs (``input_objs``) are the first layer's own saved tensor
    under a fused norm, checkpointing or fp32; a bf16 eager norm keeps an fp32 copy, so there they count apart.
    Measured to the byte on the CPU (4-layer Llama, docs/performance.md): 5, 4, 3, 0 fused; 5, 7, 5, 1 eager."""
    four = dataclasses.replace(three_layers, layers=4)  # a layer a stage; the hidden states depend on H alone
    hidden, layout = 2 * 8 * 64 * 2, Layout("hybrid_parallel", "bf16", 0, pp=4)
    fused = Workload(micro_batch=2, length=8, accumulation_steps=4, device="cpu", fused_norms=True)
    assert [p.p2p for p in plan_stages(four, layout, fused)] == [5 * hidden, 4 * hidden, 3 * hidden, 0]
    eager = dataclasses.replace(fused, fused_norms=False)
    assert [p.p2p for p in plan_stages(four, layout, eager)] == [5 * hidden, 7 * hidden, 5 * hidden, hidden]
    ckpt = dataclasses.replace(eager, checkpointing=True)  # the checkpoint keeps the received input itself
    assert [p.p2p for p in plan_stages(four, layout, ckpt)] == [5 * hidden, 4 * hidden, 3 * hidden, 0]
    fp32 = [p.p2p for p in plan_stages(four, dataclasses.replace(layout, precision="fp32"), eager)]
    # the eager norm's fp32 cast is the input itself
    assert fp32 == [5 * 2 * hidden, 4 * 2 * hidden, 3 * 2 * hidden, 0]
    # part of the gradient pass (they are gone at the optimizer step): stage 0 runs every forward in its warm-up,
    # so the gradients meet one micro-batch fewer: its layer's activations and its output
    first = plan_stages(four, layout, fused)[0]
    per_layer = layer_bytes(four, 1, 1, 8, 2, eager=False, fused_norms=True) * 16
    assert (first.in_flight, first.forwards, first.per_forward) == (4, 4, per_layer + hidden)
    assert (
        first.static == first.weights + first.masters + first.moments + first.reference + first.communication
    )
    acts = 4 * per_layer + 768 * 16
    assert first.activations == acts
    assert first.passes == max(acts + 5 * hidden, acts + 5 * hidden - per_layer - hidden + first.gradients)
    assert first.peak == first.static + max(first.passes, first.gradients + first.step_copies)


def test_held_hidden_replays_the_schedules() -> None:
    """1F1B: stage s of p holds min(p - s, m) forwards' outputs (none on the last) and inputs (none on the first),
    and one received gradient (none on the last). Interleaved, 2 stages x 2 chunks over 4 micro-batches, inputs
    kept: stage 1 at its third backward holds forwards of chunk 0 x 3 (an output each; chunk 1's output is the
    loss), the next forward's input received before that backward, and chunk 0's gradient: 5; stage 0 at its
    second, 5 forwards' outputs, the next input (chunk 1) and a gradient: 7."""
    from coati_kto.parallel.stages import held_hidden

    assert [held_hidden(s, 4, 8) for s in range(4)] == [5, 4, 3, 0]
    assert [held_hidden(s, 4, 8, input_kept=False) for s in range(4)] == [5, 7, 5, 1]
    assert [held_hidden(s, 4, 2, input_kept=False) for s in range(4)] == [3, 5, 5, 1]  # 2 in flight at most
    assert [held_hidden(s, 2, 4, "interleaved", 2) for s in range(2)] == [7, 5]


def _llama_8b() -> ModelShape:
    layer = 4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336
    return ModelShape(
        "llama", 4096, 32, 32, 8, 128, 14336, 128256, 2 * 128256 * 4096, 32 * layer, 65 * 4096, (), 4096
    )


def test_the_search_offers_pipeline_stages_at_zero_0_or_1_only() -> None:
    shape, hybrid = _llama_8b(), Layout("hybrid_parallel", "bf16", 2)
    layouts = candidates(hybrid, shape, 16, 8, sp_axis=True, pp_axis=True)
    piped = [x for x in layouts if x.pp > 1]
    assert {x.pp for x in piped} == {2, 4, 8, 16}
    assert {x.zero_stage for x in piped} == {0, 1} and all(x.zero_stage <= 1 for x in piped)
    assert all(x.sp == 1 and x.world == 16 for x in piped)  # no sequence parallelism with pp
    assert (1, 16, 1, 0) in {(x.tp, x.pp, x.dp, x.zero_stage) for x in piped}  # one dp rank: ZeRO runs as 0
    lora = candidates(hybrid, shape, 16, 8, sp_axis=False, lora=True, pp_axis=True)
    assert {x.pp for x in lora} == {1, 2, 4, 8, 16} and {x.tp for x in lora} == {1}  # LoRA: tp 1 only
    assert not [x for x in candidates(hybrid, shape, 16, 8, sp_axis=False) if x.pp > 1]  # pp_axis off
    small = dataclasses.replace(shape, layers=3)
    assert {x.pp for x in candidates(hybrid, small, 8, 8, sp_axis=False, pp_axis=True)} == {
        1,
        2,
    }  # a layer each
    assert Layout("hybrid_parallel", "bf16", 1, 2, 2, 1, False, 4).describe() == (
        "hybrid_parallel bf16, tp 2 x pp 4 1f1b x dp 2, ZeRO-1"
    )


def test_the_search_runs_pp_micro_batches_and_ranks_fewer_stages_first() -> None:
    """8B on 16 x 80 GiB: tp 1 x dp 16 fits, so it comes first; at the same ranks per replica tp 2 comes
    before pp 2; every pipelined fit runs at least pp micro-batches and none runs ZeRO 2."""
    shape, budget = _llama_8b(), usable_bytes(80)
    work = Workload(micro_batch=4, length=2048, checkpointing=True)
    fits = fitting_layouts(
        shape, Layout("hybrid_parallel", "bf16", 2), work, 16, 8, budget, False, pp_axis=True
    )
    assert (fits[0].layout.tp, fits[0].layout.pp, fits[0].layout.dp) == (1, 1, 16)
    assert "fewer pipeline stages" in RULE and "(pp-1)/(m+pp-1)" in RULE
    piped = [f for f in fits if f.layout.pp > 1]
    assert piped and all(f.microbatches >= f.layout.pp and f.layout.zero_stage <= 1 for f in piped)
    assert all(f.plan.peak <= budget for f in fits)
    assert [rank(f) for f in fits] == sorted(rank(f) for f in fits)
    order = [(f.layout.tp, f.layout.pp) for f in fits]
    assert order.index((2, 1)) < order.index((1, 2))


def test_the_configured_layout_reads_the_pipeline_fields_with_defaults() -> None:
    from coati_kto.recipe.plan import configured_layout

    plugin = SimpleNamespace(
        name="hybrid_parallel", precision="bf16", zero_stage=1, tp_size=2, cpu_offload=False, pp_size=2,
        pp_style="interleaved", num_model_chunks=2,
    )  # fmt: skip
    layout = configured_layout(plugin, 8)
    assert (layout.tp, layout.pp, layout.dp, layout.zero_stage, layout.chunks) == (2, 2, 2, 1, 2)
    assert configured_layout(plugin, 4).zero_stage == 0  # one data-parallel rank
    with pytest.raises(UserError) as err:
        configured_layout(plugin, 6)
    assert str(err.value) == "--gpus 6 is not a multiple of plugin.tp_size 2 x plugin.pp_size 2 = 4"
    plain = SimpleNamespace(
        name="hybrid_parallel", precision="bf16", zero_stage=2, tp_size=1, cpu_offload=False
    )
    assert (configured_layout(plain, 4).pp, configured_layout(plain, 4).pp_style) == (1, "1f1b")


def test_the_report_names_the_peak_stage_and_its_p2p_buffers(three_layers: ModelShape) -> None:
    from coati_kto.recipe.plan import breakdown_lines, stage_line

    work = Workload(micro_batch=2, length=8, accumulation_steps=2, device="cpu")
    plan = plan_memory(three_layers, Layout("hybrid_parallel", "bf16", 0, pp=2), work)
    assert stage_line(plan, work) == (
        "per rank of stage 1 of 2 (the peak): 2 layers, the final norm and LM head; 1f1b keeps 1 of 2 micro-batches "
        "in flight:"
    )
    lines = breakdown_lines(plan, work, three_layers)
    assert lines[-2] == "  communication     0.00 MiB  none: one data-parallel rank"
    assert lines[-1] == (
        "  p2p               0.00 MiB  1 x [2, 8, 64] hidden states, bf16 (in-flight outputs and inputs, a received "
        "gradient)"
    )


def test_plan_of_a_pipelined_config(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    """The tiny Llama (2 layers, untied) at pp 2 x dp 2, ZeRO 1 (pp's default), 2 micro-batches: stage 1 holds
    1 layer (40,960 + 128), the final norm (64) and the head (32,768): 73,920 parameters; bf16 weights 147,840 B
    = 0.14 MiB, masters and moments 12 x 36,960 B = 0.42 MiB; p2p none: the received input is what its first layer's
    fused norm keeps (model.fused_norms, on by default), and the last stage sends nothing."""
    from coati_kto.cli import main

    config = tmp_path / "cfg.yaml"
    config.write_text(PLAN_CONFIG.format(model=tiny_model_dir))
    assert main(["plan", str(config), "plugin.pp_size=2", "train.accumulation_steps=2", "--gpus", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "layout: hybrid_parallel bf16, tp 1 x pp 2 1f1b x dp 2, ZeRO-1, on 4 GPU(s), 1 node(s)"
    assert lines[2] == (
        "per rank of stage 1 of 2 (the peak): 1 layer, the final norm and LM head; 1f1b keeps 1 of 2 micro-batches "
        "in flight:"
    )
    assert lines[3] == "  weights           0.14 MiB  bf16, 73,920 parameters per tensor-parallel rank"
    assert lines[5] == "  optimizer         0.42 MiB  fp32 masters + fp32 moments, / 2 ranks"
    assert lines[11] == (
        "  p2p               0.00 MiB  0 x [4, 64, 64] hidden states, bf16 (in-flight outputs and inputs, a received "
        "gradient)"
    )
    assert lines[12].startswith("  peak  ") and lines[14].startswith("layouts that fit on 4 x 80 GiB")
    # every rank reads the whole model at load (4 x 147,776 B = 0.56 MiB); the stage it keeps is cast beside its
    # fp32 values: 6 x 73,920 B = 0.42 MiB, less
    assert lines[13].startswith("host memory at load: 0.56 MiB per rank (the most of the whole model in fp32")
    piped = [line for line in lines[14:] if " x pp " in line]
    assert piped and all("ZeRO-2" not in line and "2 micro-batches a step)" in line for line in piped)


def test_the_search_offers_the_pipeline_sizes_config_load_admits() -> None:
    """Llama and Qwen2 are proven at pp 2 and 4; LoRA's merged export is refused with pp; 32B in full with the online reference
    fits 16 GPUs only with pipeline stages: tp 2 x pp 4 x dp 2 at ZeRO 1, 1F1B over 4 micro-batches, the last
    stage (its 16 layers, the final norm and the head) the peak."""
    from coati_kto.config.load import load_config
    from coati_kto.recipe.plan import _pipeline_admitted, layouts_that_fit

    base = REPO / "configs" / "multinode_zero2.yaml"
    llama = REPO / "benchmarks" / "model_shapes" / "llama-3.1-8b"
    config = load_config(base, [f"model.path={llama}"])
    shape = model_shape(str(llama))
    fits = layouts_that_fit(config, shape, Workload.from_config(config), 16, 8, 80)
    assert {f.layout.pp for f in fits} == {1, 2, 4}
    assert _pipeline_admitted(config)
    assert _pipeline_admitted(load_config(base, [f"model.path={llama}", "model.lora={rank: 16}"]))
    merged = ["model.lora={rank: 16}", "output.merge_lora=true"]
    assert not _pipeline_admitted(load_config(base, [f"model.path={llama}", *merged]))

    qwen = REPO / "benchmarks" / "model_shapes" / "qwen2.5-32b"
    config = load_config(base, [f"model.path={qwen}"])
    shape = model_shape(str(qwen))
    work = Workload.from_config(config)
    fits = layouts_that_fit(config, shape, work, 16, 8, 80)
    assert fits and all(f.layout.pp > 1 for f in fits)
    assert fits == layouts_that_fit(config, shape, work, 16, 8, 80, unproven_pp=True)[: len(fits)]
    best = fits[0]
    assert (best.layout.tp, best.layout.pp, best.layout.dp, best.layout.zero_stage) == (2, 4, 2, 1)
    assert (best.microbatches, best.micro_batch, best.plan.stage, best.plan.stage_layers) == (4, 10, 3, 16)
