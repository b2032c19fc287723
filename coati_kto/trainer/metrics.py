"""Exact step metrics: per-micro-batch sums and counts on the device, reduced once per step, divided afterwards.

Every rank holds the same fixed set of keys whatever its labels, so the one all-reduce of a step has the same
shape and dtype on every rank (a rank whose micro-batches hold a single label adds zeros, never skips a key).
Means are formed only from reduced sums: never the mean of per-rank means. A mean whose count is 0 is left
out of the result (no NaN is ever logged).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from coati_kto.models.logit_means import LogitMeans

# Keys summed over micro-batches and data-parallel ranks. The first eighteen are one [3, 6] table, row-major: rows
# all valid examples / chosen / rejected, columns loss, reward, policy log-prob, count, and the policy's mean logit
# over the vocabulary summed over completion tokens with those tokens' count (TRL's logits/chosen|rejected:
# coati_kto.models.logit_means) (StepSums.add: one matmul).
_TABLE = (
    *("loss", "rewards", "logps", "examples", "logits", "completion_tokens"),
    *("loss/chosen", "rewards/chosen", "logps/chosen", "count/chosen"),
    *("logits/chosen", "completion_tokens/chosen"),
    *("loss/rejected", "rewards/rejected", "logps/rejected", "count/rejected"),
    *("logits/rejected", "completion_tokens/rejected"),
)
SUM_KEYS = (
    *_TABLE,
    "tokens",
    "nonfinite",  # micro-batches whose loss or rewards are NaN/inf
    "model_flops",
    "aux_loss",  # the router load-balancing loss of each gradient pass x its rows (MoE; 0 when none is added)
    "aux_rows",
)
_INDEX = {key: i for i, key in enumerate(SUM_KEYS)}
NONFINITE_EXAMPLES = (
    "nonfinite_examples"  # an evaluation's valid rows with a NaN/inf value (StepSums(evaluation))
)
_MEASURED = ("loss", "rewards", "logps", "logits", "aux_loss")  # the summed values a NaN/inf can poison


class StepSums:
    """Local sums of one optimizer step (or one evaluation) on this rank, kept on ``device`` (no host sync).

    ``kl`` collects the reference points z0 used in the step and the raw (unclamped) KL estimates they come
    from; each is already global (identical on every data-parallel rank), so they are averaged locally and
    never summed over ranks. A loss without a reference point (apo_zero_unpaired) adds none.

    ``evaluation``: also count the valid rows with a NaN/inf loss, reward, log-prob or logit sum
    (``nonfinite_examples``, after SUM_KEYS in :meth:`local_tensors`): what an evaluation reports of a
    non-finite set. A training step votes on its micro-batches (``nonfinite``) and counts no rows.
    """

    def __init__(self, device: torch.device, evaluation: bool = False) -> None:
        self._sums = torch.zeros(len(SUM_KEYS), dtype=torch.float64, device=device)
        self._rows = torch.zeros((), dtype=torch.float64, device=device) if evaluation else None
        # evaluation: whether the pass of the micro-batch add() records next had a NaN/inf router loss
        self._aux_bad: torch.Tensor | None = None
        self._kl: list[torch.Tensor] = []
        self._kl_raw: list[torch.Tensor] = []
        self._tokens, self._flops = 0, 0.0

    def add(
        self,
        losses: torch.Tensor,
        rewards: torch.Tensor,
        policy_logps: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        logits: LogitMeans | None = None,
    ) -> None:
        """Add one micro-batch: losses, rewards, policy_logps [B] float; labels, valid [B] bool; ``logits``: what
        the policy's pass over the examples recorded (None or empty: adds no token).

        Rows with ``valid`` False (evaluation padding) contribute nothing, even when their values are NaN.
        """
        # One matmul sums every (rows, value) pair: masks [B, 3] (valid, chosen, rejected) x values [B, 6] (loss,
        # reward, log-prob, valid, logit-mean sum, completion tokens), fp64 (stack promotes to the masks' dtype).
        # Invalid rows are zeroed first: a NaN survives a weight of 0.
        chosen = labels & valid
        masks = torch.stack([valid, chosen, valid ^ chosen], dim=1).double()
        if logits is not None and logits.sums is not None:
            recorded = [logits.sums, logits.tokens]
        else:
            recorded = [losses.new_zeros(()).expand_as(losses)] * 2
        values = [losses.detach(), rewards.detach(), policy_logps.detach(), masks[:, 0], *recorded]
        values = torch.where(valid[:, None], torch.stack(values, dim=1), 0.0)
        table = masks.T @ values
        self._sums[: len(_TABLE)].add_(table.flatten())
        if self._rows is not None:  # evaluation: the rows a NaN/inf comes from (x - x: NaN for inf and NaN)
            row = values.sum(dim=1)
            bad = (row - row).ne(0)
            if self._aux_bad is not None:  # the router loss is every row's: its NaN is theirs
                bad, self._aux_bad = bad | (self._aux_bad & valid), None
            self._rows.add_(bad.sum())
        # A NaN/inf reward (e.g. a -inf log-prob) can hide behind a finite loss (sigmoid saturates): flag both.
        # x - x is 0 for every finite x and NaN for inf and NaN.
        total = table[0, :2].sum()
        self._sums[_INDEX["nonfinite"]].add_((total - total).ne(0))

    def add_aux(self, aux: torch.Tensor, rows: int | torch.Tensor) -> None:
        """Add one pass's router load-balancing loss (0-dim), weighted by its ``rows`` (an int, or a 0-dim device
        tensor: an evaluation micro-batch's valid rows) as the loss weighs them; a non-finite one counts as a
        non-finite micro-batch, and in an evaluation its valid rows as non-finite examples (called before the
        micro-batch's :meth:`add`). A pass of 0 rows adds nothing (its loss over no token is 0 / 0)."""
        aux = aux.detach().to(self._sums)
        if isinstance(rows, torch.Tensor):
            rows = rows.to(self._sums)
            aux = torch.where(rows > 0, aux, 0.0)
        self._sums[_INDEX["aux_loss"]].add_(aux * rows)
        self._sums[_INDEX["aux_rows"]].add_(rows)
        self._sums[_INDEX["nonfinite"]].add_(~torch.isfinite(aux))
        if self._rows is not None:  # counted with the rows of the micro-batch add() records next
            self._aux_bad = ~torch.isfinite(aux)

    def add_host(self, tokens: int, flops: float) -> None:
        """Add one micro-batch's tokens and the model FLOPs of its passes (coati_kto.trainer.throughput), both
        counted on the host (coati_kto.data.batch.TokenCounts): kept here, no kernel per micro-batch."""
        self._tokens += tokens
        self._flops += flops

    def add_kl(self, z0: torch.Tensor, raw: torch.Tensor) -> None:
        """One reference point z0 = max(0, raw) and its unclamped estimate ``raw`` (0-dim each)."""
        self._kl.append(z0.detach().double().reshape(()))
        self._kl_raw.append(raw.detach().double().reshape(()))

    def local_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(this rank's sums, {"kl": mean z0, "kl_raw": mean raw estimate} of the step or None), 0-dim fp64 on
        the device: nothing read back (coati_kto.parallel.distributed.reduce_sums reads them with the sums)."""
        if self._kl:
            kl = torch.stack([torch.stack(self._kl).mean(), torch.stack(self._kl_raw).mean()])
        else:
            kl = self._sums.new_full((2,), float("nan"))
        keys = SUM_KEYS if self._rows is None else (*SUM_KEYS, NONFINITE_EXAMPLES)
        rows = [] if self._rows is None else [self._rows.reshape(1)]
        values = torch.cat([self._sums, *rows, kl])
        # The host counts ride as kernel arguments (a scalar add), not as a host-to-device copy.
        values[_INDEX["tokens"]].add_(self._tokens)
        values[_INDEX["model_flops"]].add_(self._flops)
        values = values.unbind()
        sums = dict(zip(keys, values[:-2], strict=True))
        return sums, ({"kl": values[-2], "kl_raw": values[-1]} if self._kl else None)

    def local(self) -> tuple[dict[str, float], dict[str, float] | None]:
        """:meth:`local_tensors` as floats: one device-to-host copy."""
        sums, kl = self.local_tensors()
        flat = torch.stack([*sums.values(), *(kl or {}).values()]).tolist()
        host = dict(zip([*sums, *(kl or {})], flat, strict=True))
        return {k: host[k] for k in sums}, ({k: host[k] for k in kl} if kl else None)


def add_totals(into: dict[str, float], totals: dict[str, float]) -> None:
    """Accumulate reduced step totals (e.g. over a logging interval); sums stay sums."""
    for key, value in totals.items():
        into[key] = into.get(key, 0.0) + value


def summarize(totals: dict[str, float], kl: dict[str, float] | None) -> dict[str, float]:
    """Means from global sums: loss per example, rewards and log-probs per label, the policy's mean logit per
    completion token of each label, margins when both labels exist (TRL's names); none of them from a step or
    evaluation with a non-finite micro-batch (its counts only).

    ``totals`` holds SUM_KEYS reduced over the data-parallel group; ``kl`` the global {"kl", "kl_raw"} (z0
    and the unclamped estimate) or None (no reference point). Keys whose count is 0 are omitted.
    """
    out: dict[str, float] = {}
    if totals["examples"] > 0 and totals["nonfinite"] == 0:
        out["loss"] = totals["loss"] / totals["examples"]
    if kl is not None:
        out.update(kl)
    if totals.get("aux_rows", 0) > 0 and totals["nonfinite"] == 0:  # the mean router loss of the passes
        out["aux_loss"] = totals["aux_loss"] / totals["aux_rows"]
    means = {}
    for side in ("chosen", "rejected"):
        count = totals[f"count/{side}"]
        out[f"count/{side}"] = count
        # Non-finite sums (one inf row turns its label's and, through the table's 0 weights, the other's) are
        # no measurement: no mean is logged from them, as no loss is.
        if count > 0 and totals["nonfinite"] == 0:
            means[side] = totals[f"rewards/{side}"] / count
            out[f"rewards/{side}"] = means[side]
            out[f"logps/{side}"] = totals[f"logps/{side}"] / count
        tokens = totals.get(f"completion_tokens/{side}", 0.0)
        if tokens > 0 and totals["nonfinite"] == 0:  # TRL's: per completion token, never a mean of means
            out[f"logits/{side}"] = totals[f"logits/{side}"] / tokens
    if len(means) == 2:
        out["rewards/margins"] = means["chosen"] - means["rejected"]
    return out


def nonfinite_metrics(totals: dict[str, float]) -> list[str]:
    """The measured sums of ``totals`` (reduced) that are NaN/inf: a value's column of the table is poisoned by
    one non-finite valid row of it, so these name what the set's non-finite rows held."""
    return [key for key in _MEASURED if key in totals and not math.isfinite(totals[key])]


def evaluated(totals: dict[str, float], kl: dict[str, float] | None, seconds: float) -> dict[str, float]:
    """An evaluation's metrics (keys without prefix) from its reduced ``totals``: one interval of the meter (its
    means and throughput), and ``nonfinite_examples``, the rows no mean could be taken over, where there are any
    (a finite evaluation's record keeps its keys, as a count of 0 leaves a mean out)."""
    meter = IntervalMeter()
    meter.add(totals, kl, seconds, None)
    rows = totals.get(NONFINITE_EXAMPLES, 0.0)
    return meter.measured() | ({NONFINITE_EXAMPLES: rows} if rows > 0 else {})


class IntervalMeter:
    """Reduced step totals over a logging interval (``train.log_interval`` steps; 1 = every step).

    Sums stay sums, so the logged means are exact over all micro-batches, ranks and steps of the interval;
    z0 and the grad norm are per-step global values, averaged with equal weight per step. Skipped (non-finite)
    steps add nothing but their count (``skipped_steps``) and time: their sums may be NaN.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.totals: dict[str, float] = {}
        self.kl: list[dict[str, float]] = []
        self.grad_norms: list[float] = []
        self.seconds = 0.0
        self.steps = 0  # every step of the interval, skipped ones included
        self.skipped = 0
        self.ends_now = False  # a resume's open interval to log at once (load)

    def state(self) -> dict[str, Any]:
        """The open interval, for a checkpoint: a run resumed from it logs the interval's record as the run would
        have (it began empty: the steps before the checkpoint were missing from every record). The same on every
        rank (global sums)."""
        return copy.deepcopy({k: v for k, v in vars(self).items() if k != "ends_now"})

    def load(self, state: dict[str, Any] | None, ends_now: bool = False) -> None:
        """Continue the interval :meth:`state` saved (None: a checkpoint from before it was saved: start empty).
        ``ends_now``: the interval's length changed (``train.log_interval``), so its steps so far are a record of
        their own at the resumed step, not mixed into the new length's first."""
        self.reset()
        if state is not None:
            vars(self).update({k: v for k, v in copy.deepcopy(state).items() if k != "ends_now"})
            self.ends_now = ends_now and self.steps > 0

    def add(
        self,
        totals: dict[str, float],
        kl: dict[str, float] | None,
        seconds: float,
        grad_norm: float | None,
        skipped: bool = False,
    ) -> None:
        """Add a step's reduced totals. ``skipped``: the fp16 loss scaler skipped its update (an overflow in the
        scaled gradients); its sums are finite and enter the means, and it counts in ``skipped_in_interval``."""
        add_totals(self.totals, totals)
        if kl is not None:
            self.kl.append(kl)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        self.seconds += seconds
        self.steps += 1
        self.skipped += skipped

    def skip(self, seconds: float) -> None:
        """Count a skipped step: nothing of it enters the means."""
        self.seconds += seconds
        self.steps += 1
        self.skipped += 1

    def summary(self) -> dict[str, float]:
        """``skipped_in_interval`` and :meth:`measured` (keys without prefix). An interval of skipped steps only
        has no means, just ``skipped_in_interval``."""
        out: dict[str, float] = {"skipped_in_interval": float(self.skipped)}
        if self.totals:
            out.update(self.measured())
        return out

    def measured(self) -> dict[str, float]:
        """Means of the interval's added totals (:func:`summarize`), its mean grad norm, and its throughput: examples,
        tokens and model FLOPs per second of its wall time (keys without prefix). Evaluation reads it too."""
        kl = {k: sum(d[k] for d in self.kl) / len(self.kl) for k in self.kl[0]} if self.kl else None
        out = summarize(self.totals, kl)
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        if self.seconds > 0:
            out["examples_per_second"] = self.totals["examples"] / self.seconds
            out["tokens_per_second"] = self.totals["tokens"] / self.seconds
            out["model_flops_per_second"] = self.totals.get("model_flops", 0.0) / self.seconds
        return out
