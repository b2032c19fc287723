"""TRL's ``logits/chosen`` and ``logits/rejected`` from passes that never hold the [B, S, V] logits.

TRL's KTOTrainer (since huggingface/trl#6424, "Align KTO with DPO") logs the mean over the vocabulary of the
policy's logits at each completion token, summed over the completion tokens of a label's rows and divided by
their count. Here a pass adds, per row, that sum and the token count (:class:`LogitMeans`); the trainer reduces
both over its micro-batches and data-parallel ranks before dividing (``coati_kto.trainer.metrics``).

The chunked LM head forms no logits, but their sum over the vocabulary is linear in the hidden state:
sum_v (h . w_v + b_v) = h . (sum_v w_v) + sum_v b_v, so one column sum of the head's weight and one
[N, H] x [H] product per pass give it, with no [N, V] block: 1-2% of the head's forward on a CPU (fp32 and bf16,
V 32k-152k, H 512-1024), under 1% of its forward and backward. The logits path (tensor parallelism, parameters
not resident in the forward, soft-capped heads) sums the logits it holds in one reduction. Both are fp32 and carry no gradient; TRL averages
its logits in the model's dtype, so a bf16 run's values agree with TRL's to bf16's rounding.

Only passes inside :func:`recording` add anything: the trainer records the policy's pass over the examples, and
pauses the recording (``recording(None)``) around the KL pairs' passes that share its forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_CPU_ROWS = 4096  # rows of the head's weight upcast at a time for its column sum on a CPU
_ACTIVE: list[LogitMeans | None] = [None]  # the recorder passes add to, set by recording()


class LogitMeans:
    """One pass's per-row sums: ``sums`` [B] fp32, over the row's completion tokens of the token's mean logit over
    the vocabulary, and ``tokens`` [B] fp32, those tokens' count. None until the pass records."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None

    def add(self, sums: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record one scoring of the examples; a second one in the same pass would count its tokens twice."""
        if self.sums is not None:
            raise RuntimeError("logit means recorded twice in one pass (a KL pass ran while recording)")
        self.sums, self.tokens = sums, tokens


@contextlib.contextmanager
def recording(recorder: LogitMeans | None) -> Iterator[LogitMeans | None]:
    """Within: the completion log-prob functions add their logit means to ``recorder`` (None: to nothing)."""
    before, _ACTIVE[0] = _ACTIVE[0], recorder
    try:
        yield recorder
    finally:
        _ACTIVE[0] = before


def active_recorder() -> LogitMeans | None:
    """The recorder passes add to now (:func:`recording`'s), or None."""
    return _ACTIVE[0]


def sum_per_row(
    values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """Sum per row b of the values at (rows, cols) of a [B, T] grid: Tensor[B] (scatter then sum, deterministic;
    ``coati_kto.models.logprobs`` sums its token log-probs with it too)."""
    grid = torch.zeros(shape, dtype=values.dtype, device=values.device)
    return grid.index_put((rows, cols), values).sum(dim=1)


def _add(means: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int]) -> None:
    """Add per-position means [N] at (rows, cols) of a [B, T] grid to the active recorder, with their count."""
    counts = sum_per_row(torch.ones_like(means), rows, cols, shape)
    _ACTIVE[0].add(sum_per_row(means, rows, cols, shape), counts)


def record_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    cols: torch.Tensor,
    shape: tuple[int, int],
) -> None:
    """While recording: the mean logit of ``hidden`` [N, H] (the scored positions) through the head ``weight``
    [V, H] and ``bias``, added per row of the [B, T] grid ``shape`` the positions (rows, cols) fall in."""
    if _ACTIVE[0] is None:
        return
    with torch.no_grad():
        sums = hidden.float() @ _column_sum(weight)
        if bias is not None:
            sums = sums + bias.sum(dtype=torch.float32)
        _add(sums / weight.shape[0], rows, cols, shape)


def _column_sum(weight: torch.Tensor) -> torch.Tensor:
    """sum_v weight[v] in fp32 [H]: one reduction kernel on an accelerator (a memory pass over the head, a few
    percent of the head's matmul); on a CPU in row blocks upcast one at a time, which ran 10x faster there than
    torch's reduction over dim 0 with an fp32 accumulator (bf16, 32k x 512)."""
    if weight.device.type != "cpu":
        return weight.sum(0, dtype=torch.float32)
    total = torch.zeros(weight.shape[1], dtype=torch.float32)
    for v in range(0, weight.shape[0], _CPU_ROWS):
        total += weight[v : v + _CPU_ROWS].float().sum(0)
    return total


def record_logits(
    logits: torch.Tensor,
    at: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
    shape: tuple[int, int],
) -> None:
    """While recording: the mean over the vocabulary of ``logits`` [R, K, V] at the positions ``at`` (row, column),
    added per row of the [B, K] grid ``shape`` (``rows``: each position's row there; the columns are ``at``'s).

    One reduction over the whole block, then the positions picked: it reads the logits once and copies none (a
    gather of the positions' [N, V] rows first took 3x as long on a CPU, fp32)."""
    if _ACTIVE[0] is None:
        return
    with torch.no_grad():
        means = logits.detach().sum(-1, dtype=torch.float32)[at] / logits.shape[-1]
        _add(means, rows, at[1], shape)
