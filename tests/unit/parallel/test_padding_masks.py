"""The plan counts sdpa's padding masks on padded rows: transformers hands sdpa a boolean [R, 1, L, L] mask where a
micro-batch's rows differ in length, and sdpa converts it to the working dtype in every layer and keeps that copy
for the backward, with the grouped key-value heads repeated. The plan left them out (every pipeline stage runs
padded rows, and ``data.padding_free`` is off by default): measured here against the tensors autograd keeps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.parallel.activations import Workload, activation_bytes
from coati_kto.parallel.memory_plan import Layout, plan_stages
from coati_kto.parallel.model_shape import model_shape

ROWS, LENGTH, LAYERS = 2, 64, 3
REPEATED = (4 - 2) * 8  # random_causal_lm's 4 query over 2 key-value heads of 8: the columns k and v gain


@pytest.fixture(scope="module")
def grouped_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of 4 query over 2 key-value heads (sdpa repeats them under a mask), saved for ``model_shape``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.testing.tiny import random_causal_lm

    folder = tmp_path_factory.mktemp("grouped_llama")
    random_causal_lm(LlamaForCausalLM, LlamaConfig, num_hidden_layers=LAYERS).save_pretrained(folder)
    return folder


def _kept_bytes(model: torch.nn.Module, padded: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the decoder's backward on ROWS x LENGTH tokens."""
    ids = torch.randint(
        0, model.config.vocab_size, (ROWS, LENGTH), generator=torch.Generator().manual_seed(0)
    )
    attention_mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    if padded:
        attention_mask[0, : LENGTH // 4] = 0  # one row shorter: the others' length pads it
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.model(input_ids=ids, attention_mask=attention_mask)
    return sum(kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_masks_sdpa_keeps_on_padded_rows_are_what_the_plan_adds(grouped_llama: Path, dtype) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(grouped_llama, attn_implementation="sdpa", dtype=dtype)
    measured = _kept_bytes(model, padded=True) - _kept_bytes(model, padded=False)
    shape, working = model_shape(str(grouped_llama)), dtype.itemsize
    work = Workload(micro_batch=ROWS, length=LENGTH, device="cpu")
    padded = dataclasses.replace(work, padded_mask=True)
    plain = activation_bytes(shape, 1, 1, working, work, last=False)[0]
    planned = activation_bytes(shape, 1, 1, working, padded, last=False)[0]
    # Per layer: the mask in the working dtype, and k and v repeated from 2 to 4 heads of 8 columns.
    mask, repeat = ROWS * LENGTH * LENGTH * working, 2 * ROWS * LENGTH * REPEATED * working
    assert measured == LAYERS * (mask + repeat)
    assert planned - plain == measured


def test_checkpointing_keeps_the_recomputed_layers_mask_only(grouped_llama: Path) -> None:
    shape = model_shape(str(grouped_llama))
    work = Workload(micro_batch=ROWS, length=LENGTH, checkpointing=True, device="cpu")
    padded = dataclasses.replace(work, padded_mask=True)
    extra = (
        activation_bytes(shape, 1, 1, 2, padded, last=False)[0]
        - activation_bytes(shape, 1, 1, 2, work, last=False)[0]
    )
    assert (
        extra == ROWS * LENGTH * LENGTH * 2 + 2 * ROWS * LENGTH * REPEATED * 2
    )  # one mask, one layer's repeat


def test_a_config_plans_them_where_sdpa_gets_padded_rows(tmp_path: Path, grouped_llama: Path) -> None:
    """Padded rows (data.padding_free off, or any pipeline stage) under sdpa; not eager (the mask is added, not
    kept), and not padding-free rows (the packed mask, counted once)."""
    path = write_config(tmp_path, MINIMAL.replace("some/model", str(grouped_llama)))

    def planned(*overrides: str) -> bool:
        return Workload.from_config(
            load_config(path, ["model.attn_implementation=sdpa", *overrides])
        ).padded_mask

    assert planned("train.micro_batch_size=2")
    assert not planned("train.micro_batch_size=2", "data.padding_free=true")  # the packed mask instead
    assert not planned("train.micro_batch_size=2", "model.attn_implementation=eager")
    piped = ["plugin.name=hybrid_parallel", "plugin.pp_size=2", "train.accumulation_steps=2"]
    assert planned("train.micro_batch_size=2", "data.padding_free=true", *piped)


def test_every_pipeline_stage_keeps_them_per_micro_batch_in_flight(grouped_llama: Path) -> None:
    """1F1B's stage 0 of 3 keeps 3 micro-batches' activations: its one layer's mask for each of them."""
    shape = model_shape(str(grouped_llama))
    layout = Layout("hybrid_parallel", "bf16", 1, pp=3)
    work = Workload(micro_batch=ROWS, length=LENGTH, accumulation_steps=3, device="cpu")
    plain = plan_stages(shape, layout, work)
    masked = plan_stages(shape, layout, dataclasses.replace(work, padded_mask=True))
    per_batch = ROWS * LENGTH * LENGTH * 2 + 2 * ROWS * LENGTH * REPEATED * 2
    assert [m.in_flight for m in masked] == [3, 2, 1]
    assert [m.activations - p.activations for m, p in zip(masked, plain, strict=True)] == [
        3 * per_batch,
        2 * per_batch,
        per_batch,
    ]
    # the packed mask a padding-free config asks for becomes the padded one under pp
    packed = plan_stages(shape, layout, dataclasses.replace(work, dense_mask=True))
    assert [p.activations for p in packed] == [m.activations for m in masked]
