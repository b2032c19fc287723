"""Padded passes on sdpa's causal kernel with no mask (coati_kto.models.packing.padded_attention and
coati_kto.models.lm_head.causal_sdpa_without_checks).

Rows are right-padded, so a real token's causal keys are all real: the padded passes handed sdpa a dense
[B, 1, L, L] mask (on a GPU: no flash kernel, the mask read by every layer) that changed only the padding
positions' outputs. Now they give none, and a forward with no mask no longer reads the device inside
transformers' mask builder (its packed-sequence check: one host sync per pass on a GPU). Exact against each row
alone, log-probs and gradients; a sliding window shorter than the row keeps its 4D mask.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from coati_kto.data.collator import KTOCollator
from coati_kto.models.lm_head import LMHead
from coati_kto.models.packing import padded_logps
from coati_kto.testing.attention_paths import SDPA_CAUSAL, SDPA_DENSE, function_path
from coati_kto.testing.syncs import HostSyncCounter
from coati_kto.testing.tiny import random_causal_lm

PROMPT = 5  # completion_start of every row


class _AttentionPaths(TorchFunctionMode):
    """The attention path of every sdpa call inside (coati_kto.testing.attention_paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        path = function_path(func, args, kwargs)
        if path is not None:
            self.paths.append(path)
        return func(*args, **kwargs)


def _rows(lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(7 * i + 3 * n) % 190 + 3 for i in range(n)] for n in lengths]


def _view(rows: list[list[int]]) -> Any:
    features = [
        dict(input_ids=r, completion_start=PROMPT, label=True, kl_input_ids=r, kl_completion_start=PROMPT)
        for r in rows
    ]
    return KTOCollator(0)(features).example


def _padded_logps(model: Any, view: Any) -> torch.Tensor:
    return padded_logps(model, view, LMHead.find(model))


def _alone(model: Any, row: list[int]) -> torch.Tensor:
    """The row's completion log-prob from transformers' own forward on the row alone (full logits, its 2D mask)."""
    ids = torch.tensor([row])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, :-1].float()
    token = logits.log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
    return token[PROMPT - 1 :].sum()


def _grads(model: Any) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _check_against_rows_alone(model: Any, rows: list[list[int]]) -> list[str]:
    """Log-probs and gradients of one padded pass equal each row alone; returns the pass's attention paths."""
    view = _view(rows)
    with _AttentionPaths() as paths:
        got = _padded_logps(model, view)
    got.sum().backward()
    padded_grads = _grads(model)
    expected = []
    for row in rows:
        logp = _alone(model, row)
        logp.backward()
        expected.append(logp.detach())
    row_grads = _grads(model)
    torch.testing.assert_close(got.detach(), torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert padded_grads.keys() == row_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(grad, row_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    return paths.paths


def test_padded_rows_take_the_causal_kernel_exactly() -> None:
    model = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    rows = _rows((14, 9, 11))  # two shorter rows: the view is padded
    assert _view(rows).padded
    paths = _check_against_rows_alone(model, rows)
    assert paths == [SDPA_CAUSAL] * 2, paths  # one call per layer, none on a dense mask (before: SDPA_DENSE)
    assert model.config._attn_implementation == "sdpa"  # the alias lasts one forward


def test_no_pass_reads_the_device_padded_or_not() -> None:
    """Before, a view without padding gave transformers no mask, and its packed-sequence check synced."""
    model = random_causal_lm(LlamaForCausalLM, LlamaConfig, attn_implementation="sdpa")
    for lengths in ((12, 12), (12, 8)):
        view = _view(_rows(lengths))
        assert view.padded == (lengths[0] != lengths[1])
        with HostSyncCounter() as syncs:
            _padded_logps(model, view)
        assert syncs.total == 0, (lengths, syncs.by_place)


def test_a_window_shorter_than_the_row_keeps_its_mask() -> None:
    model = random_causal_lm(MistralForCausalLM, MistralConfig, attn_implementation="sdpa", sliding_window=4)
    for p in model.parameters():  # sharp weights: a wrong window shows in the log-probs
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    paths = _check_against_rows_alone(model, _rows((13, 8)))
    assert paths == [SDPA_DENSE] * 2, paths
