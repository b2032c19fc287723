"""Scalars to TensorBoard and W&B, and the progress bar: written by the main rank only.

Every rank builds a ``MetricWriter`` (so callers need no rank checks); on non-main ranks it holds no writer and
every call is a no-op. Values arrive already reduced over the data-parallel group (see trainer/metrics.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from coati_kto.trainer.metrics import NONFINITE_EXAMPLES, nonfinite_metrics
from coati_kto.trainer.run_summary import config_markdown, data_stats_markdown, flat_hparams


class MetricWriter:
    """TensorBoard under ``tensorboard_dir`` and/or a W&B run, on the main rank.

    ``purge_step``: on resume from optimizer step t pass t, so TensorBoard drops the events a crashed or stopped
    run wrote from its last checkpoint on (a stop's partial interval, an earlier resume's evaluation at t) and the
    step axis continues in the same directory; :meth:`replay` then writes again what the checkpoint kept of step t
    (:meth:`written_at`), once however often the run is resumed from it.
    """

    def __init__(
        self,
        is_main: bool,
        tensorboard_dir: str | Path | None = None,
        purge_step: int | None = None,
        wandb_settings: dict[str, Any] | None = None,
    ) -> None:
        self._tb = None
        self._wandb = None
        # TensorBoard's writes at the latest step (written_at), and whether the run's events were there before
        self._kept: tuple[int, list[tuple[str, Any, Any]]] = (-1, [])
        self._continuing = False
        if not is_main:
            return
        if tensorboard_dir is not None:
            folder = Path(tensorboard_dir)
            # events there already: the run this one resumes (a resume into a new output.dir starts afresh)
            self._continuing = folder.is_dir() and any(folder.glob("events.out.tfevents.*"))
            try:
                self._open(folder, purge_step)
            except OSError as err:  # a folder it cannot write: as a write that fails later
                self._stopped(err)
        if wandb_settings is not None:
            self._wandb = _init_wandb(**wandb_settings)

    def _open(self, folder: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write finite scalars at ``step`` (names like ``train/loss``); a NaN never reaches the dashboards."""
        finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self._scalars(finite, step)
        if self._wandb is not None and finite:
            self._wandb.log(finite, step=step)

    def _scalars(self, finite: dict[str, float], step: int) -> None:
        self._to_tensorboard(lambda tb: [tb.add_scalar(k, v, global_step=step) for k, v in finite.items()])
        self._keep(step, "scalars", finite, None)

    def _keep(self, step: int, kind: str, key: Any, value: Any) -> None:
        if self._tb is None:
            return
        if self._kept[0] != step:
            self._kept = (step, [])
        self._kept[1].append((kind, key, value))

    def written_at(self, step: int) -> list[tuple[str, Any, Any]]:
        """What TensorBoard got at ``step`` (the latest step written), but the run's own text (``run/``, which a
        resumed run writes anew): for a checkpoint of ``step`` to keep. Empty without TensorBoard."""
        return list(self._kept[1]) if self._kept[0] == step else []

    def replay(self, written: list[tuple[str, Any, Any]], step: int) -> None:
        """Write :meth:`written_at`'s entries at ``step`` again, to TensorBoard only (W&B cannot purge: it has them),
        where the run's events are (not into a new directory)."""
        for kind, key, value in written if self._continuing else []:
            if kind == "scalars":
                self._scalars(key, step)
            elif kind == "text":
                self.text(key, value, step)
            else:
                self.image(key, value, step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        """A TensorBoard TEXT entry (rendered as markdown) under ``tag`` itself: ``SummaryWriter.add_text`` would
        write it as ``tag/text_summary`` (the text plugin reads any tag; the suffix is only torch's naming)."""
        if self._tb is None:
            return
        from torch.utils.tensorboard.summary import text

        summary = text(tag, markdown)
        summary.value[0].tag = tag
        self._to_tensorboard(lambda tb: tb.file_writer.add_summary(summary, step))
        if not tag.startswith("run/"):
            self._keep(step, "text", tag, markdown)

    def run_summary(self, run_config: dict | None, data_stats: dict | None, step: int) -> None:
        """The resolved config and the data statistics as TEXT (the config also as hparams), at the start step."""
        if run_config is not None:
            self.text("run/config", config_markdown(run_config), step)
            self.hparams(flat_hparams(run_config), ("eval/loss", "eval/rewards/margins"))
        if data_stats is not None:
            self.text("run/data", data_stats_markdown(data_stats), step)
        self.flush()

    def image(self, tag: str, chw: Any, step: int) -> None:
        """A TensorBoard image (``chw``: a CHW uint8 array) under ``tag`` at ``step``."""
        self._to_tensorboard(lambda tb: tb.add_image(tag, chw, global_step=step, dataformats="CHW"))
        self._keep(step, "image", tag, chw)

    def table(
        self, key: str, columns: list[str], rows: list[list[Any]], step: int, images: list[Any] | None = None
    ) -> None:
        """A W&B table under ``key`` at ``step`` (TensorBoard gets tables as TEXT: :meth:`text`); ``images``
        (CHW uint8 arrays or None, one per row) fill an ``image`` column."""
        if self._wandb is not None:
            import wandb

            if images is not None:
                columns = [*columns, "image"]
                rows = [
                    [*row, None if image is None else wandb.Image(image.transpose(1, 2, 0))]
                    for row, image in zip(rows, images, strict=True)
                ]
            self._wandb.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def hparams(self, params: dict[str, float | int | str | bool], metric_tags: Iterable[str]) -> None:
        """The run's hyperparameters for TensorBoard's HPARAMS tab, in this run's own directory.

        ``SummaryWriter.add_hparams`` would open a second run in a sub-directory; writing the plugin's three
        summaries into this writer keeps one run, whose ``metric_tags`` scalars fill the tab's metric columns.
        """
        if self._tb is None:
            return
        from torch.utils.tensorboard.summary import hparams

        summaries = hparams(params, {tag: float("nan") for tag in metric_tags})
        self._to_tensorboard(lambda tb: [tb.file_writer.add_summary(summary) for summary in summaries])

    def flush(self) -> None:
        self._to_tensorboard(lambda tb: tb.flush())

    def close(self) -> None:
        self._to_tensorboard(lambda tb: tb.close())
        self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def _to_tensorboard(self, write: Any) -> None:
        """``write(writer)``; an OSError (disk full, a read-only filesystem) stops TensorBoard with one warning
        instead of the run with a traceback: checkpoints report their own failures."""
        if self._tb is None:
            return
        try:
            write(self._tb)
        except OSError as err:
            self._stopped(err)

    def _stopped(self, err: OSError) -> None:
        tb, self._tb = self._tb, None
        where = f": {err.filename}" if err.filename else ""
        print(
            f"warning: TensorBoard stopped ({err.strerror or err}{where}); training goes on, and the "
            "console and W&B still get the metrics",
            file=sys.stderr,
            flush=True,
        )
        if tb is not None:
            with contextlib.suppress(OSError):
                tb.close()


# A run that goes on skipping says so on each of its first skips, then as the count doubles: a diverged run
# skips every step, and a line per step would bury the progress bar.
SKIP_LINES_IN_FULL = 10


def warn_skipped_step(is_main: bool, step: int, epoch: int, bad_grad: bool, skipped_steps: int) -> None:
    """One warning line on the main rank for a training step skipped under ``train.on_nonfinite: skip``
    (``skipped_steps``: the run's count, this step included); every skip up to SKIP_LINES_IN_FULL, then the
    powers of two. A step the fp16 loss scaler skips is not one: that is the scaler's normal search."""
    if not is_main or (skipped_steps > SKIP_LINES_IN_FULL and skipped_steps & (skipped_steps - 1)):
        return
    what = "gradient norm" if bad_grad else "KTO loss or rewards"
    later = (
        " (from here on, a line each time the count doubles)" if skipped_steps == SKIP_LINES_IN_FULL else ""
    )
    print(
        f"warning: non-finite (NaN/inf) {what} at optimizer step {step} (epoch {epoch}): step skipped, the "
        f"weights not updated (train.on_nonfinite=skip); {skipped_steps} skipped so far, "
        f"train/skipped_steps{later}",
        file=sys.stderr,
        flush=True,
    )


def warn_nonfinite_eval(
    is_main: bool, step: int, totals: dict[str, float], kl: dict[str, float] | None = None
) -> None:
    """One warning line on the main rank when an evaluation's reduced ``totals`` hold a NaN/inf: which measured
    values (coati_kto.trainer.metrics.nonfinite_metrics) and how many of its examples; its means are not logged
    (as a non-finite training step's are not), ``eval/nonfinite_examples`` counts the examples. ``kl``: the
    evaluation's z0 ({"kl": ..., "kl_raw": ...}, one value over the whole set): a non-finite one is named as
    the cause every example's loss shares (one NaN KL pair made every row count). Silent when finite."""
    metrics = nonfinite_metrics(totals)
    rows, batches = totals.get(NONFINITE_EXAMPLES, 0.0), totals.get("nonfinite", 0.0)
    if not is_main or not (metrics or rows > 0 or batches > 0):
        return
    what = ", ".join(metrics) or "loss"
    z0 = (kl or {}).get("kl_raw", 0.0)
    shared = (
        "; z0 (eval/kl_raw, the eval set's KL pairs) is non-finite and every example's loss holds it"
        if not math.isfinite(z0)
        else ""
    )
    print(
        f"warning: non-finite (NaN/inf) eval {what} at optimizer step {step}: {rows:.0f} of "
        f"{totals.get('examples', 0.0):.0f} eval examples{shared}; the evaluation's means are not logged "
        f"(eval/{NONFINITE_EXAMPLES} counts the examples). Check the data or the model",
        file=sys.stderr,
        flush=True,
    )


# The W&B run of an output directory, beside wandb's own files (output.overwrite clears both).
WANDB_RUN_ID = "wandb/coati-kto-run-id"


def _init_wandb(
    project: str,
    mode: str,
    dir: str | Path,
    config: dict | None = None,
    name: str | None = None,
    resume: bool = False,
):
    """Start a W&B run. ``mode="offline"`` writes under ``dir/wandb`` and needs no network or login.

    ``resume`` (a run resumed from a checkpoint): the W&B run this directory's earlier run started goes on, as
    TensorBoard's curves go on in one directory; each resume opened a new W&B run, splitting every curve. Steps
    an interrupted run logged after its last checkpoint are not rewritten (W&B keeps a run's steps increasing).
    A ``WANDB_RUN_ID`` the user set is wandb's own choice and wins."""
    import wandb

    id_file = Path(dir) / WANDB_RUN_ID
    id_file.parent.mkdir(parents=True, exist_ok=True)
    earlier = {}
    if resume and "WANDB_RUN_ID" not in os.environ and id_file.is_file():
        earlier = {"id": id_file.read_text().strip(), "resume": "allow"}
    run = wandb.init(project=project, mode=mode, dir=str(dir), config=config, name=name, **earlier)
    if run.id != earlier.get("id"):
        scratch = id_file.with_name(f".{id_file.name}.{os.getpid()}")
        scratch.write_text(run.id + "\n")
        scratch.replace(id_file)
    return run


_SHOWN = {
    "loss": "train/loss",
    "kl": "train/kl",
    "margin": "train/rewards/margins",
    "compiled graphs": "train/compiled_graphs",  # model.compile: a count that grows means recompiles
}


class ProgressBar:
    """Progress over optimizer steps on the main rank, showing the step's loss, kl and margin; silent elsewhere.

    On a terminal: a tqdm bar. In a log file (SLURM, CI, colossalai run's pipes) a bar's carriage returns do not
    erase anything, so other lines would fuse with it: there, whole lines instead (``train step 3/9: ...``),
    the first and last step and at most one every ``log_every_s`` seconds in between.
    """

    def __init__(
        self,
        is_main: bool,
        total: int | None,
        initial: int = 0,
        interactive: bool | None = None,
        log_every_s: float = 30.0,
    ) -> None:
        self._enabled = is_main
        self._interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = None
        self._total, self._step = total, initial
        self._log_every_s, self._last_line = log_every_s, -math.inf
        if is_main and self._interactive:
            self._bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, mininterval=0.1)

    def update(self, metrics: dict[str, float]) -> None:
        shown = {
            k: f"{metrics[v]:{'.0f' if 'graphs' in k else '.4f'}}" for k, v in _SHOWN.items() if v in metrics
        }
        self._step += 1
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
            return
        now = time.monotonic()
        due = now - self._last_line >= self._log_every_s or self._step == self._total
        if self._enabled and due:
            self._last_line = now
            of = f"/{self._total}" if self._total else ""
            values = " ".join(f"{k} {v}" for k, v in shown.items())
            print(f"train step {self._step}{of}: {values}", file=sys.stderr, flush=True)

    def write(self, line: str) -> None:
        """A whole line (e.g. an evaluation's result) that never shares a line with the bar."""
        if self._bar is not None:
            self._bar.write(line)
        elif self._enabled:
            sys.stderr.flush()
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
