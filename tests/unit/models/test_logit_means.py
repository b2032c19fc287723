"""TRL's logits/ metrics without the logits: what each log-prob path records (coati_kto.models.logit_means)
against transformers' full logits, masked and averaged by hand; the KL pairs' passes record nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coati_kto.data.collator import KTOCollator
from coati_kto.models.lm_head import LMHead
from coati_kto.models.logit_means import LogitMeans, record_head, recording
from coati_kto.models.packing import packed_logps, padded_logps, pair_logps


def _rows(seed: int, labels: list[bool]) -> list[dict]:
    """Prepared rows of random lengths (so the batch pads): prompt 2-6 tokens, completions 1-8."""
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(
            3, 390, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen
        ).tolist()

    rows = []
    for label in labels:
        prompt = draw(2, 7)
        rows.append(
            {
                "input_ids": prompt + draw(1, 9),
                "completion_start": len(prompt),
                "label": label,
                "kl_input_ids": prompt + draw(1, 9),
                "kl_completion_start": len(prompt),
            }
        )
    return rows


def _by_hand(model: torch.nn.Module, view) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum over completion tokens of the full logits' mean over the vocabulary (fp64), and the count."""
    with torch.no_grad():
        logits = model(input_ids=view.input_ids, attention_mask=view.attention_mask).logits.double()
    mask = view.loss_mask[:, 1:].double()
    return (logits[:, :-1].mean(-1) * mask).sum(1), mask.sum(1)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["head", "logits"])
def test_padded_pass_records_the_masked_mean_logit(model: torch.nn.Module, path: str) -> None:
    batch = KTOCollator(pad_token_id=0)(_rows(0, [True, False, True, False, True]))
    head = LMHead.find(model) if path == "head" else None
    assert (head is not None) == (path == "head")
    with torch.no_grad(), recording(LogitMeans()) as means:
        padded_logps(model, batch.example, head)
    sums, tokens = _by_hand(model, batch.example)
    assert means.tokens.tolist() == tokens.tolist() and min(tokens.tolist()) >= 1
    torch.testing.assert_close(means.sums.double(), sums, rtol=1e-5, atol=1e-5)
    assert sums.abs().max() > 1e-2  # a mean logit that is not 0: the test could tell a wrong sum


@pytest.mark.parametrize("path", ["head", "logits"])
def test_packed_pass_records_the_examples_and_never_the_kl_pairs(model: torch.nn.Module, path: str) -> None:
    """One packed forward scores example and KL pair: the examples' logit means only (a second record raises)."""
    batch = KTOCollator(pad_token_id=0)(_rows(1, [False, True, True, False]))
    with torch.no_grad(), recording(LogitMeans()) as means:
        if path == "head":
            pair_logps(model, batch)  # packs (a plain Llama, sdpa), through the chunked head
        else:
            packed_logps(model, None, batch.pairs, len(batch))
    sums, tokens = _by_hand(model, batch.example)
    assert means.tokens.tolist() == tokens.tolist()
    torch.testing.assert_close(means.sums.double(), sums, rtol=1e-5, atol=1e-5)


def test_nothing_is_recorded_outside_recording_or_twice_in_one_pass(model: torch.nn.Module) -> None:
    batch = KTOCollator(pad_token_id=0)(_rows(2, [True, False]))
    head = LMHead.find(model)
    with torch.no_grad():
        padded_logps(model, batch.example, head)  # no recorder: nothing to add to, nothing fails
        with recording(LogitMeans()), pytest.raises(RuntimeError, match="recorded twice in one pass"):
            padded_logps(model, batch.example, head)
            padded_logps(model, batch.kl, head)


def test_head_sum_with_a_bias_equals_the_logits_mean() -> None:
    """sum_v (h . w_v + b_v) / V from the weight's column sum equals the mean of the [N, V] logits."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight, bias = (torch.randn(*shape, generator=gen) for shape in ((7, 16), (300, 16), (300,)))
    rows, cols = torch.tensor([0, 0, 1, 2, 2, 2, 2]), torch.tensor([1, 2, 0, 0, 1, 3, 4])
    with recording(LogitMeans()) as means:
        record_head(hidden, weight, bias, rows, cols, (3, 5))
    per_position = torch.nn.functional.linear(hidden.double(), weight.double(), bias.double()).mean(-1)
    expected = torch.zeros(3, dtype=torch.float64).index_add_(0, rows, per_position)
    torch.testing.assert_close(means.sums.double(), expected, rtol=1e-5, atol=1e-6)
    assert means.tokens.tolist() == [2.0, 1.0, 4.0]
