"""The LR schedule (the first warmup step uses lr / (warmup + 1), not 0; after warmup, transformers' cosine)
and the progress lines written to a log (whole lines, never fused with other output)."""

from __future__ import annotations

import os

import pytest
import torch

from coati_kto.trainer.schedule import lr_factor, warmup_decay_schedule


def _lrs(warmup: int, total: int, min_ratio: float, lr: float = 1.0) -> list[float]:
    """The lr each optimizer step 1..total uses (read before the step, as the trainer logs it)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = warmup_decay_schedule(optimizer, warmup, total, min_ratio)
    out = []
    for _ in range(total):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


def test_first_warmup_step_is_above_zero() -> None:
    lrs = _lrs(warmup=3, total=10, min_ratio=0.1, lr=2.0)
    assert lrs[:4] == pytest.approx([0.5, 1.0, 1.5, 2.0])  # 2 x k / 4, then the full lr at step 4
    assert lrs[4] < lrs[3] and lrs[-1] > 0.2  # cosine towards 0.1 x lr, reached after the last step
    assert _lrs(warmup=0, total=5, min_ratio=0.0)[0] == 1.0


def test_after_warmup_it_is_transformers_cosine_with_min_lr() -> None:
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 2, 9, min_lr_rate=0.2)
    factors = [theirs.lr_lambdas[0](s) for s in range(9)]
    assert factors[0] == 0.0  # what this schedule fixes
    ours = [lr_factor(s, 2, 9, 0.2) for s in range(9)]
    assert ours[:2] == pytest.approx([1 / 3, 2 / 3])
    assert ours[2:] == pytest.approx(factors[2:], abs=1e-12)


def test_linear_after_warmup_is_transformers_linear_and_ends_at_the_floor() -> None:
    """``train.lr_schedule: linear`` (TRL's default schedule): transformers' linear decay after the warmup."""
    from transformers.optimization import get_linear_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_linear_schedule_with_warmup(optimizer, 3, 10)
    factors = [theirs.lr_lambdas[0](s) for s in range(10)]
    ours = [lr_factor(s, 3, 10, 0.0, "linear") for s in range(10)]
    assert ours[:3] == pytest.approx([1 / 4, 2 / 4, 3 / 4])
    assert ours[3:] == pytest.approx(factors[3:], abs=1e-12) and ours[-1] == pytest.approx(1 / 7)
    floored = [lr_factor(s, 0, 4, 0.2, "linear") for s in range(5)]
    assert floored == pytest.approx(
        [1.0, 0.8, 0.6, 0.4, 0.2]
    )  # 0.2 + 0.8 x (1 - s/4), the floor after the run
    scheduler = warmup_decay_schedule(
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0), 0, 4, 0.2, "linear"
    )
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.0, 1.6, 1.2, 0.8])


def test_progress_lines_in_a_log_are_whole_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from coati_kto.trainer.logging import ProgressBar

    bar = ProgressBar(True, total=3, interactive=False, log_every_s=3600)
    for loss in (0.7, 0.6, 0.5):
        bar.update({"train/loss": loss, "train/kl": 0.0, "train/rewards/margins": 0.1})
        if loss == 0.6:
            bar.write("step 2: eval loss 0.6500")
    bar.close()
    out = capsys.readouterr()
    # The first and the last step (at most one line per log_every_s in between); no carriage returns.
    assert out.err.splitlines() == [
        "train step 1/3: loss 0.7000 kl 0.0000 margin 0.1000",
        "train step 3/3: loss 0.5000 kl 0.0000 margin 0.1000",
    ]
    assert out.out == "step 2: eval loss 0.6500\n"
    silent = ProgressBar(False, total=3, interactive=False)
    silent.update({"train/loss": 0.1})
    silent.write("not shown")
    assert capsys.readouterr() == ("", "")


def test_rebase_lr_makes_a_new_peak_from_the_current_step() -> None:
    """A restored LambdaLR kept the saved run's base lr: a resume with a new train.lr was silently ignored."""
    from coati_kto.trainer.schedule import rebase_lr, warmup_decay_schedule

    def run(lr: float, steps: int) -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        sched = warmup_decay_schedule(opt, 2, 10, 0.1)
        for _ in range(steps):
            opt.step()
            sched.step()
        return opt, sched

    saved_opt, saved = run(1e-3, 4)
    opt, sched = run(1e-3, 0)
    opt.load_state_dict(saved_opt.state_dict())
    sched.load_state_dict(saved.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * lr_factor(4, 2, 10, 0.1))
    rebase_lr(sched, 5e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4 * lr_factor(4, 2, 10, 0.1))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4 * lr_factor(5, 2, 10, 0.1))
    assert sched.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_warmup_longer_than_the_run_is_said(tmp_path) -> None:
    """train.warmup_steps longer than the run was accepted silently: the lr never reached train.lr (issue 17)."""
    from helpers import MINIMAL, write_config

    from coati_kto.config.load import load_config
    from coati_kto.trainer.schedule import schedule_notes

    config = load_config(write_config(tmp_path, MINIMAL), ["train.warmup_steps=10", "train.lr=1e-3"])
    assert schedule_notes(config.train, 4, 8, 1) == [
        "warning: train.warmup_steps 10 is not shorter than the run (4 optimizer steps): the learning rate "
        "never reaches train.lr 0.001 (peak 0.000364)"
    ]
    shorter = load_config(write_config(tmp_path, MINIMAL), ["train.warmup_steps=3"])
    assert schedule_notes(shorter.train, 4, 8, 1) == []


def test_accumulation_longer_than_an_epoch_is_said(tmp_path) -> None:
    """From an audit of degenerate sizes: accumulation_steps 8 over an epoch of 2 micro-batches per rank trained
    steps of 8 examples while the card said 32, and nothing was said."""
    from helpers import MINIMAL, write_config

    from coati_kto.config.load import load_config
    from coati_kto.trainer.schedule import schedule_notes

    config = load_config(
        write_config(tmp_path, MINIMAL), ["train.accumulation_steps=8", "train.micro_batch_size=2"]
    )
    assert schedule_notes(config.train, 2, 2, 2) == [
        "note: train.accumulation_steps 8 is more than the 2 micro-batches each data-parallel rank has per epoch: "
        "each optimizer step holds one epoch, 8 examples, not the 32 the batch settings multiply to"
    ]
    assert schedule_notes(config.train, 2, 8, 2) == []  # a whole window fits in the epoch


def test_padding_free_with_a_dense_mask_on_a_gpu_is_said(tmp_path) -> None:
    from helpers import MINIMAL, write_config

    from coati_kto.config.load import load_config
    from coati_kto.models.packing import padding_free_note

    path = write_config(tmp_path, MINIMAL)
    free = load_config(path, ["data.padding_free=true", "model.attn_implementation=sdpa"])
    note = padding_free_note(free.data, free.model, cuda=True)
    assert note.startswith("note: data.padding_free with attention sdpa: ") and "flex_attention" in note
    # CPU: the dense mask is what runs, nothing to choose
    assert padding_free_note(free.data, free.model, cuda=False) is None
    flex = load_config(path, ["data.padding_free=true", "model.attn_implementation=flex_attention"])
    assert padding_free_note(flex.data, flex.model, cuda=True) is None
    plain = load_config(path)
    assert padding_free_note(plain.data, plain.model, cuda=True) is None


def test_a_tensorboard_write_that_fails_stops_tensorboard_not_the_run(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A read-only or full output filesystem made the event writer raise OSError out of the training loop (a
    traceback on rank 0, the other ranks SIGTERMed). Now one warning, and the run goes on."""
    import errno

    from coati_kto.trainer.logging import MetricWriter

    writer = MetricWriter(True, tmp_path / "tb")
    writer.log({"train/loss": 0.5}, 1)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "tb" / "events"))

    writer._tb.add_scalar = read_only
    writer.log({"train/loss": 0.4}, 2)
    writer.log({"train/loss": 0.3}, 3)  # TensorBoard is off: no second warning
    writer.flush()
    writer.close()
    assert capsys.readouterr().err.splitlines() == [
        f"warning: TensorBoard stopped (Read-only file system: {tmp_path / 'tb' / 'events'}); training goes on, "
        "and the console and W&B still get the metrics"
    ]
    # A folder it cannot open at all (from an audit: a traceback before the first step): the same warning
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root writes anywhere: a file where the folder should be
            (tmp_path / "ro" / "tb").write_text("")
        refused = MetricWriter(True, tmp_path / "ro" / "tb")
        refused.log({"train/loss": 0.5}, 1)
        refused.close()
    finally:
        (tmp_path / "ro").chmod(0o700)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: TensorBoard stopped (") and line.endswith(
        "the console and W&B still get the metrics"
    )
