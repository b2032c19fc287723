"""``DataPosition.epochs`` (``train/epoch``, TRL's fractional epoch) across resumes."""

from __future__ import annotations

import pytest

from coati_kto.trainer.position import DataPosition


def _run(resume: dict, micro_batches: int, steps: int) -> list[float]:
    """``train/epoch`` after each of ``steps`` one-micro-batch steps of epoch 0, resumed from ``resume``, on a
    loader of ``micro_batches`` (a plain list: the consumed prefix is skipped)."""
    position = DataPosition(accumulation_steps=1)
    position.resume_from(resume)
    out = []
    for _ in zip(range(steps), position.steps(list(range(micro_batches)), 0), strict=False):
        position.consumed += 1
        out.append(position.epochs())
    return out


def test_a_second_resume_inside_a_replanned_epoch_goes_on_from_the_saved_fraction() -> None:
    """One rank of 100 micro-batches stopped at 50 (0.5); resumed on 2 ranks, the rest re-planned to 25 each,
    saved at 10 of them (0.5 + 0.5 x 10 / 25 = 0.7). Resumed again on that layout, it goes on from 0.7: 0.9 at
    20. It went on from 10 / 25 = 0.4 (0.8 at 20), and saved that."""
    got = _run({"epoch": 0, "consumed": 10, "epoch_progress": 0.7, "sampler": None}, 25, 15)
    assert got[9] == pytest.approx(0.9) and got[-1] == pytest.approx(1.0)


def test_a_resume_of_an_epoch_never_replanned_logs_what_the_uninterrupted_run_did() -> None:
    whole = _run({"epoch": 0, "consumed": 0, "epoch_progress": None, "sampler": None}, 25, 25)
    resumed = _run({"epoch": 0, "consumed": 10, "epoch_progress": whole[9], "sampler": None}, 25, 15)
    assert resumed == pytest.approx(whole[10:], abs=1e-15)
    old = _run({"epoch": 0, "consumed": 10, "sampler": None}, 25, 15)  # a checkpoint without epoch_progress
    assert old == pytest.approx(whole[10:], abs=1e-15)


class _Loader:
    """A DataLoader's view the trainer uses: its batch sampler, its length, its micro-batches."""

    def __init__(self, sampler) -> None:
        self.batch_sampler = sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        return iter(self.batch_sampler)


def test_a_resume_at_a_smaller_micro_batch_runs_what_it_plans_and_mixes_every_micro_batch() -> None:
    """746:254 at micro-batch 4, saved after 10 steps, resumed at micro-batch 2: the minority left (244) is fewer
    than the micro-batches, so it repeats; the planned count (``left_in_epoch``) is what runs, every micro-batch
    holds both labels, the epoch fraction ends at 1, and a second resume inside it goes on in the same order."""
    np = pytest.importorskip("numpy")
    from coati_kto.data.sampler import MixedLabelBatchSampler

    labels = np.random.default_rng(0).permutation(np.array([True] * 746 + [False] * 254))
    old, first = _Loader(MixedLabelBatchSampler(labels, 4, seed=42)), DataPosition(accumulation_steps=1)
    for _ in zip(range(10), first.steps(old, 0), strict=False):
        first.consumed += 1
    saved = first.state(old, 0)

    def resumed(state: dict, stop: int | None = None) -> tuple[tuple[int, int] | None, list, dict, float]:
        loader, position = (
            _Loader(MixedLabelBatchSampler(labels, 2, seed=42)),
            DataPosition(accumulation_steps=1),
        )
        position.resume_from(state)
        left, run = position.left_in_epoch(loader), []
        for (batch,) in position.steps(loader, 0):
            position.consumed += 1
            run.append(batch)
            if len(run) == stop:
                break
        return left, run, position.state(loader, 0), position.epochs()

    left, run, _, done = resumed(saved)
    assert left == (0, len(run)) and done == pytest.approx(1.0)
    assert all(len(set(labels[b].tolist())) == 2 for b in run)
    _, head, again, _ = resumed(saved, stop=7)
    left2, tail, _, done2 = resumed(again)
    assert head + tail == run and left2 == (0, len(tail)) and done2 == pytest.approx(1.0)
