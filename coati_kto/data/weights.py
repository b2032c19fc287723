"""The KTO class weights (lambda_D, lambda_U) and the imbalance report, from the sampler's counts per epoch.

The KTO paper keeps (lambda_D n_D) / (lambda_U n_U) in [1, 4/3]. n_D and n_U are what one epoch actually
shows the loss: :meth:`MixedLabelBatchSampler.compute_stats`'s effective counts (minority repeats included,
left-out rows excluded), which depend on the micro-batch size and the number of data-parallel ranks. The
report is therefore computed for a given layout and config, never stored with the prepared data (neither
``train.micro_batch_size`` nor ``kto.*`` is in its fingerprint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coati_kto.config.kto import KTOSection
from coati_kto.data.sampler import MixedLabelBatchSampler
from coati_kto.errors import DataError, UserError

GUIDELINE = (1.0, 4.0 / 3.0)  # KTO paper: (lambda_D n_D) / (lambda_U n_U) in [1, 4/3]
AUTO_TARGET = 7.0 / 6.0  # auto weights aim at the middle of the guideline, safe from rounding at its edges


def auto_weights(n_desirable: int, n_undesirable: int) -> tuple[float, float]:
    """(lambda_D, lambda_U) with (lambda_D n_D) / (lambda_U n_U) in [1, 4/3].

    Data already inside the guideline keeps (1, 1). Otherwise the ratio is set to 7/6 (the middle of the
    guideline) by lowering one weight and keeping the larger at 1, so the loss scale (and the effective
    learning rate) never grows.
    """
    ratio = n_desirable / n_undesirable
    if GUIDELINE[0] <= ratio <= GUIDELINE[1]:
        return 1.0, 1.0
    scale = AUTO_TARGET / ratio  # lambda_D / lambda_U
    return (scale, 1.0) if scale < 1 else (1.0, 1.0 / scale)


@dataclass(frozen=True)
class WeightSettings:
    """What the weight report reads of the config: the ``kto`` section (``desirable_weight``,
    ``undesirable_weight``, ``auto_weights``) and ``train.micro_batch_size``, which sets the effective counts."""

    kto: KTOSection
    micro_batch_size: int


def imbalance(settings: WeightSettings, stats: dict, num_replicas: int) -> dict[str, Any]:
    """The imbalance report for ``num_replicas`` data-parallel ranks (effective counts from the sampler).

    ``stats``: the prepared data's stats (only ``stats["train"]["labels"]`` is read). A layout the sampler
    refuses gives ``{"error": ..., "report": ...}`` instead of weights.
    """
    n_d, n_u = stats["train"]["labels"]["desirable"], stats["train"]["labels"]["undesirable"]
    kto, mbs = settings.kto, settings.micro_batch_size
    out: dict[str, Any] = {
        "n_desirable": n_d,
        "n_undesirable": n_u,
        "micro_batch_size": mbs,
        "num_replicas": num_replicas,
    }
    try:
        s = MixedLabelBatchSampler.compute_stats(n_d, n_u, mbs, num_replicas)
    except (ValueError, UserError) as err:  # the sampler refuses a layout with ConfigError or DataError
        return {**out, "error": str(err), "report": f"imbalance: cannot lay out micro-batches: {err}"}
    e_d, e_u = s.effective_desirable, s.effective_undesirable
    if kto.auto_weights:
        w_d, w_u = auto_weights(e_d, e_u)
    else:
        w_d, w_u = kto.desirable_weight, kto.undesirable_weight
    ratio = (w_d * e_d) / (w_u * e_u)
    inside = GUIDELINE[0] - 1e-9 <= ratio <= GUIDELINE[1] + 1e-9
    how = "auto" if kto.auto_weights else "configured"
    report = (
        f"kto weights ({how}): desirable {w_d:.4g}, undesirable {w_u:.4g}; (lambda_D n_D)/(lambda_U n_U) = "
        f"({w_d:.4g} x {e_d})/({w_u:.4g} x {e_u}) = {ratio:.3f} "
        f"{'inside' if inside else 'OUTSIDE'} the KTO guideline [1, 4/3] "
        f"(examples per epoch, micro_batch_size {mbs}, {num_replicas} rank{'s' * (num_replicas > 1)})"
    )
    if not inside:
        sd, su = auto_weights(e_d, e_u)
        report = (
            f"warning: {report}; set kto.auto_weights=true (desirable_weight {sd:.4g}, "
            f"undesirable_weight {su:.4g})"
        )
    return {
        **out,
        "effective_desirable": e_d,
        "effective_undesirable": e_u,
        "minority_repeats": s.minority_repeats,
        "left_out": s.left_out,
        "desirable_weight": w_d,
        "undesirable_weight": w_u,
        "auto_weights": kto.auto_weights,
        "ratio": ratio,
        "guideline": list(GUIDELINE),
        "inside_guideline": inside,
        "report": report,
    }


def resolve_kto_weights(
    settings: WeightSettings, stats: dict, num_replicas: int, prepared_dir: str
) -> tuple[float, float, str]:
    """(desirable_weight, undesirable_weight, one-line report) for ``num_replicas`` data-parallel ranks.

    Uses the sampler's effective counts per epoch (minority repeats included). ``kto.auto_weights``: see
    :func:`auto_weights`; otherwise the configured weights, and the report warns when outside [1, 4/3].
    Raises DataError naming ``prepared_dir`` (``data.prepared_dir``, the data's home) when the sampler cannot lay
    out micro-batches for this layout.
    """
    info = imbalance(settings, stats, num_replicas)
    if "error" in info:
        raise DataError(f"data.prepared_dir {prepared_dir}: {info['error']}")
    return info["desirable_weight"], info["undesirable_weight"], info["report"]
