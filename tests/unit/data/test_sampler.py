"""MixedLabelBatchSampler: every guarantee checked on the indices it yields, not on exit codes."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from coati_kto.data.sampler import MixedLabelBatchSampler, SamplerStats, padding_saved, padding_tokens
from coati_kto.errors import UserError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_labels(n_desirable: int, n_undesirable: int, seed: int = 0) -> np.ndarray:
    """Labels in a random arrangement: the sampler must not depend on where each label sits."""
    labels = np.array([True] * n_desirable + [False] * n_undesirable)
    return labels[np.random.default_rng(seed).permutation(len(labels))]


def epoch_batches(labels, m: int, r: int, seed: int = 0, epoch: int = 0, **kw) -> list[list[list[int]]]:
    """Per rank, the micro-batches of one epoch, each rank from its own sampler as in a real launch."""
    out = []
    for rank in range(r):
        s = MixedLabelBatchSampler(labels, m, num_replicas=r, rank=rank, seed=seed, **kw)
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) == s.epoch_stats.micro_batches_per_rank
        out.append(batches)
    return out


@st.composite
def setups(draw):
    """Ratios 1:1 to 1:20 (either label the minority), 1-8 replicas, micro-batches 2-16, up to 5000 examples."""
    m = draw(st.integers(2, 16))
    r = draw(st.integers(1, 8))
    n = draw(st.integers(m * r, 5000))
    n_minor = draw(st.integers(max(1, math.ceil(n / 21)), n // 2))
    desirable_minor = draw(st.booleans())
    n_d, n_u = (n_minor, n - n_minor) if desirable_minor else (n - n_minor, n_minor)
    return n_d, n_u, m, r, draw(st.integers(0, 2**16)), draw(st.booleans())


def check_epoch(
    n_d: int, n_u: int, m: int, r: int, seed: int, drop_last: bool, **kw
) -> list[list[list[int]]]:
    """Assert guarantees 1-5 for one epoch; returns the per-rank batches."""
    labels = make_labels(n_d, n_u, seed)
    n = n_d + n_u
    n_minor, n_major = sorted((n_d, n_u))
    minor_label = n_d < n_u
    ranks = epoch_batches(labels, m, r, seed, drop_last=drop_last, **kw)
    stats = MixedLabelBatchSampler.compute_stats(n_d, n_u, m, r, drop_last)
    assert len({len(b) for b in ranks}) == 1  # 3. equal lengths: no collective hangs
    flat = [i for batches in ranks for b in batches for i in b]
    k = len(flat) // m
    assert k == stats.num_micro_batches == r * stats.micro_batches_per_rank
    minor_counts = []
    for batches in ranks:
        for b in batches:
            assert len(b) == m and len(set(b)) == m  # never the same example twice in one micro-batch
            c = int((labels[b] == minor_label).sum())
            assert 1 <= c <= m - 1  # 1. both labels
            assert abs(c - m * n_minor / n) <= 1  # 2. ratio within one
            minor_counts.append(c)
    assert max(minor_counts) - min(minor_counts) <= 1
    uses = Counter(flat)
    used_minor = [uses[i] for i in np.flatnonzero(labels == minor_label)]
    used_major = [uses[i] for i in np.flatnonzero(labels != minor_label)]
    assert sum(used_minor) == (stats.effective_desirable if minor_label else stats.effective_undesirable)
    assert sum(used_major) == (stats.effective_undesirable if minor_label else stats.effective_desirable)
    assert used_minor.count(0) + used_major.count(0) == stats.left_out
    for used in (used_minor, used_major):  # each example floor or ceil of its label's mean
        assert max(used) - min(used) <= 1
    k0 = r * (n // (r * m))
    if drop_last and n_minor >= k0:  # 4. no repetition: unique indices, < R*m left out
        assert k == k0 and len(set(flat)) == len(flat)
        assert n - len(flat) == stats.left_out < r * m
        assert sum(used_minor) == min(max((2 * k * m * n_minor + n) // (2 * n), k), n_minor)
        assert stats.minority_repeats == 0
    elif drop_last:  # 5. minority repeated evenly, one per micro-batch, the majority all used
        assert k == r * (n_major // ((m - 1) * r)) >= k0
        assert set(minor_counts) == {1}
        assert min(used_minor) >= 1 and max(used_major) == 1
        assert used_major.count(0) == stats.left_out < r * (m - 1)
        assert stats.minority_repeats == k - n_minor > 0
        assert stats.minority_uses == (k // n_minor, -(-k // n_minor)) == (min(used_minor), max(used_minor))
    else:  # drop_last=False: nothing left out, spare slots filled by re-use
        assert stats.left_out == 0 and min(used_minor) >= 1 and min(used_major) >= 1
        if n_minor >= r * -(-n // (r * m)):
            assert len(flat) - n == stats.repeated_slots < r * m
    return ranks


@SETTINGS
@given(setups())
def test_guarantees_hold_for_any_mix(setup) -> None:
    check_epoch(*setup)


@SETTINGS
@given(setups(), st.integers(0, 3))
def test_deterministic_and_epochs_differ(setup, epoch: int) -> None:
    n_d, n_u, m, r, seed, drop_last = setup
    labels = make_labels(n_d, n_u, seed)
    a = epoch_batches(labels, m, r, seed, epoch, drop_last=drop_last)
    assert a == epoch_batches(labels, m, r, seed, epoch, drop_last=drop_last)
    if n_d + n_u >= 64:  # a coincidence is astronomically unlikely at this size
        assert a != epoch_batches(labels, m, r, seed, epoch + 1, drop_last=drop_last)


@SETTINGS
@given(setups(), st.integers(0, 3), st.data())
def test_resume_anywhere_equals_uninterrupted(setup, epoch: int, data) -> None:
    n_d, n_u, m, r, seed, drop_last = setup
    labels = make_labels(n_d, n_u, seed)
    rank = data.draw(st.integers(0, r - 1))
    full = MixedLabelBatchSampler(labels, m, r, rank, seed, drop_last)
    full.set_epoch(epoch)
    this_epoch = list(full)
    full.set_epoch(epoch + 1)
    next_epoch = list(full)
    pos = data.draw(st.integers(0, len(this_epoch)))

    # Rank 0 saves mid-epoch (trainers save one state for all ranks): positions agree across ranks.
    saver = MixedLabelBatchSampler(labels, m, r, 0, seed, drop_last)
    saver.set_epoch(epoch)
    it = iter(saver)
    for _ in range(pos):
        next(it)
    state = saver.state_dict()
    assert state["epoch"] == epoch and state["position"] == pos
    assert all(isinstance(v, int) for v in state.values())

    # The full state carries the seed (a wrong constructor seed is overridden); the trainer may pass only
    # epoch and position.
    for given_state, ctor_seed in ((state, seed + 1), ({"epoch": epoch, "position": pos}, seed)):
        fresh = MixedLabelBatchSampler(labels, m, r, rank, seed=ctor_seed, drop_last=drop_last)
        fresh.load_state_dict(given_state)
        fresh.set_epoch(epoch)  # the trainer re-selects the saved epoch: the skip must survive
        assert len(fresh) == len(this_epoch) - pos
        assert list(fresh) == this_epoch[pos:]
        assert fresh.state_dict()["position"] == len(this_epoch)
        fresh.set_epoch(epoch + 1)  # the skip applies to the saved epoch only
        assert len(fresh) == len(next_epoch)
        assert list(fresh) == next_epoch


@settings(max_examples=50, deadline=None)
@given(setups(), st.integers(0, 2**16))
def test_length_grouping_keeps_guarantees(setup, len_seed: int) -> None:
    n_d, n_u, m, r, seed, drop_last = setup
    lengths = np.random.default_rng(len_seed).integers(1, 512, n_d + n_u)
    check_epoch(n_d, n_u, m, r, seed, drop_last, lengths=lengths, group_by_length=True)


# The seeds' dataset, by hand. micro-batch 2: K0 = R*floor(1000/2R) = 500 > 254 undesirable, so each
# micro-batch holds 1 undesirable + 1 desirable and K = R*floor(746/R). Values: per rank, minority slots,
# left out (all desirable).  R=3: 3*248=744; R=5: 5*149=745; R=7: 7*106=742.
SEEDS_MBS2 = {
    1: (746, 746, 0),
    2: (373, 746, 0),
    3: (248, 744, 2),
    4: (186, 744, 2),
    5: (149, 745, 1),
    6: (124, 744, 2),
    7: (106, 742, 4),
    8: (93, 744, 2),
}
# micro-batch 4: K = R*floor(1000/4R) >= 254? R=1: 250 <= 254, no repetition; minority slots =
# clamp(round(4K*254/1000), K, 254): R=1,2,5: K=250 -> 254; R=3: 249 -> round(252.98)=253; R=4,8: 248 ->
# round(251.97)=252; R=6: 246 -> round(249.94)=250; R=7: 245 -> round(248.92)=249. Left out = 1000 - 4K.
SEEDS_MBS4 = {
    1: (250, 254, 0),
    2: (125, 254, 0),
    3: (83, 253, 4),
    4: (62, 252, 8),
    5: (50, 254, 0),
    6: (41, 250, 16),
    7: (35, 249, 20),
    8: (31, 252, 8),
}


@pytest.mark.parametrize("m,table", [(2, SEEDS_MBS2), (4, SEEDS_MBS4)])
@pytest.mark.parametrize("r", range(1, 9))
def test_seeds_746_254(m: int, table: dict, r: int) -> None:
    per_rank, minority_slots, left_out = table[r]
    ranks = check_epoch(746, 254, m, r, seed=0, drop_last=True)
    labels = make_labels(746, 254, 0)
    assert all(labels[b].any() and not labels[b].all() for batches in ranks for b in batches)  # 100% mixed
    stats = MixedLabelBatchSampler.compute_stats(746, 254, m, r)
    assert stats.micro_batches_per_rank == per_rank and stats.left_out == left_out
    assert stats.effective_undesirable == minority_slots
    assert stats.effective_desirable == per_rank * r * m - minority_slots
    assert stats.minority_label is False
    uses = Counter(i for batches in ranks for b in batches for i in b if not labels[i])
    if m == 2:  # 254 undesirable fill K slots: K-508 of them 3 times, the rest twice
        assert stats.minority_repeats == minority_slots - 254
        assert stats.minority_uses == (2, 3)
        assert sorted(Counter(uses.values()).items()) == [
            (2, 762 - minority_slots),
            (3, minority_slots - 508),
        ]
    else:
        assert stats.minority_repeats == 0 and set(uses.values()) == {1} and len(uses) == minority_slots


def test_positions_and_order_are_shuffled() -> None:
    labels = make_labels(500, 500)
    (batches,) = epoch_batches(labels, 2, 1)
    first = np.array([labels[b[0]] for b in batches])
    assert 0.4 < first.mean() < 0.6  # not a fixed T,F,T,F pattern
    assert (first[1:] != first[:-1]).mean() < 0.7
    labels = make_labels(746, 254)
    (batches,) = epoch_batches(labels, 4, 1)
    where = Counter(b.index(next(i for i in b if not labels[i])) for b in batches)
    assert len(where) == 4 and min(where.values()) > 30  # the undesirable sits at any position


def test_left_out_examples_change_between_epochs() -> None:
    labels = make_labels(700, 303)  # 1003 examples, micro-batch 4 x 2 ranks: 3 left out per epoch
    seen = set()
    for epoch in range(5):
        used = {i for batches in epoch_batches(labels, 4, 2, epoch=epoch) for b in batches for i in b}
        left = frozenset(set(range(1003)) - used)
        assert len(left) == 3
        seen.add(left)
    assert len(seen) == 5


def test_iterating_the_resumed_epoch_again_is_whole() -> None:
    labels = make_labels(60, 40)
    s = MixedLabelBatchSampler(labels, 4, 2, 1)
    s.load_state_dict({"epoch": 2, "position": 5})
    s.set_epoch(2)
    assert len(list(s)) == 12 - 5
    assert len(list(s)) == len(s) == 12  # the offset was used up by the resumed pass


def test_epoch_stats_match_compute_stats() -> None:
    s = MixedLabelBatchSampler(make_labels(746, 254), 2, 4, 3)
    assert isinstance(s.epoch_stats, SamplerStats)
    assert s.epoch_stats == MixedLabelBatchSampler.compute_stats(746, 254, 2, 4)
    assert s.epoch_stats.repeats_minority and s.epoch_stats.minority_per_micro_batch == (1, 1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"labels": [True, False] * 4, "micro_batch_size": 1}, "micro_batch_size must be >= 2"),
        ({"labels": [True] * 8, "micro_batch_size": 2}, "8 desirable and 0 undesirable"),
        ({"labels": [0] * 8, "micro_batch_size": 2}, "0 desirable and 8 undesirable"),
        (
            {"labels": [True, False] * 3, "micro_batch_size": 4, "num_replicas": 2},
            "fewer than one global batch",
        ),
        (
            {"labels": [True, False] * 8, "micro_batch_size": 2, "num_replicas": 2, "rank": 2},
            "rank 2 out of range",
        ),
        ({"labels": [True, False] * 8, "micro_batch_size": 2, "rank": -1}, "out of range"),
        (
            {"labels": [True, False] * 8, "micro_batch_size": 2, "num_replicas": 0},
            "num_replicas must be >= 1",
        ),
        ({"labels": [2, 0] * 8, "micro_batch_size": 2}, "bool or 0/1"),
        ({"labels": [True, False] * 8, "micro_batch_size": 2, "group_by_length": True}, "needs lengths"),
    ],
)
def test_errors_say_what_to_change(kwargs: dict, message: str) -> None:
    # Data too small for one global batch, or without a label: user errors (one line under the CLI: a 3-example
    # run printed a ValueError traceback on every rank).
    user = "desirable and" in message or "global batch" in message
    with pytest.raises(UserError if user else ValueError, match=message):
        MixedLabelBatchSampler(**kwargs)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(-1, 17), st.integers(0, 9))
def test_invalid_setups_raise(n_d: int, n_u: int, m: int, r: int) -> None:
    invalid = m < 2 or r < 1 or n_d == 0 or n_u == 0 or n_d + n_u < m * r
    if invalid:  # a setup mistake is a ValueError; data too small or single-label, a one-line user error
        with pytest.raises((ValueError, UserError)):
            MixedLabelBatchSampler.compute_stats(n_d, n_u, m, r)
        with pytest.raises((ValueError, UserError)):
            MixedLabelBatchSampler(make_labels(n_d, n_u), m, r)
    else:
        assert check_epoch(n_d, n_u, m, r, seed=0, drop_last=True)


def test_bad_state_raises() -> None:
    labels = make_labels(60, 40)
    state = MixedLabelBatchSampler(labels, 4, 2).state_dict()
    for key, value in [("num_replicas", 4), ("micro_batch_size", 2), ("dataset_size", 99), ("drop_last", 0)]:
        with pytest.raises(ValueError, match=f"{key}="):
            MixedLabelBatchSampler(labels, 4, 2).load_state_dict({**state, key: value})
    with pytest.raises(ValueError, match="position"):
        MixedLabelBatchSampler(labels, 4, 2).load_state_dict({**state, "position": 13})
    with pytest.raises(ValueError, match="lacks"):
        MixedLabelBatchSampler(labels, 4, 2).load_state_dict({"epoch": 1})


def test_length_grouping_saves_padding() -> None:
    rng = np.random.default_rng(0)
    labels = make_labels(746, 254)
    lengths = np.clip(rng.lognormal(5.0, 0.7, 1000).astype(int), 8, 2048)
    without, with_grouping = padding_saved(labels, lengths, 4)
    assert with_grouping < 0.25 * without
    assert padding_tokens([[0, 1], [2]], [3, 5, 7]) == 2


def test_works_as_dataloader_batch_sampler() -> None:
    torch = pytest.importorskip("torch")
    labels = make_labels(30, 10)
    data = torch.arange(40)
    loader = torch.utils.data.DataLoader(data, batch_sampler=MixedLabelBatchSampler(labels, 4))
    got = [batch.tolist() for batch in loader]
    assert len(got) == len(loader) == 10 and all(len(b) == 4 for b in got)


# ---------------------------------------------------------------------------------- resume on another layout
def _old_run_states(labels, m: int, r: int, seed: int, epoch: int, positions: list[int]) -> list[dict]:
    """Every rank's state after consuming positions[rank] micro-batches of ``epoch`` (as the trainer saves it)."""
    states = []
    for rank, position in enumerate(positions):
        s = MixedLabelBatchSampler(labels, m, num_replicas=r, rank=rank, seed=seed)
        s.set_epoch(epoch)
        states.append({**s.state_dict(), "position": position})
    return states


def _resumed(labels, m: int, r: int, seed: int, states: list[dict]) -> list[list[list[int]]]:
    """Per new rank, the micro-batches it yields for the rest of the saved epoch."""
    out = []
    for rank in range(r):
        s = MixedLabelBatchSampler(labels, m, num_replicas=r, rank=rank, seed=seed)
        s.load_state_dicts(states)
        s.set_epoch(int(states[0]["epoch"]))  # what the trainer does: keeps the resumed epoch
        expected = len(s)
        out.append(list(s))
        assert len(out[-1]) == expected
    return out


@st.composite
def relayouts(draw):
    """An interrupted epoch on r_old ranks (micro-batch m_old), resumed on r_new ranks with micro-batch m_new."""
    m_old, m_new = draw(st.integers(2, 8)), draw(st.integers(2, 8))
    r_old, r_new = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    n = draw(st.integers(max(m_old * r_old, m_new * r_new), 600))
    n_d = draw(st.integers(1, n - 1))
    labels = make_labels(n_d, n - n_d, draw(st.integers(0, 99)))
    stats = MixedLabelBatchSampler.compute_stats(n_d, n - n_d, m_old, r_old)
    per_rank = stats.micro_batches_per_rank
    # The trainer's ranks stay in step, but the re-plan must not rely on it: positions may differ.
    position = draw(st.integers(0, per_rank))
    positions = [draw(st.integers(max(0, position - 1), min(per_rank, position + 1))) for _ in range(r_old)]
    return labels, m_old, r_old, m_new, r_new, draw(st.integers(0, 2**16)), draw(st.integers(0, 3)), positions


@SETTINGS
@given(relayouts())
# Found by hypothesis: two repeated examples of a 5:5 remainder dealt into 2 micro-batches put one of them
# twice in one micro-batch; the swap that spreads copies refused any example already in the row.
@example((np.array([False] * 5 + [True] * 2), 2, 1, 5, 1, 0, 0, [0]))
# Fewer minority examples left than micro-batches (micro-batch 4 -> 2): rows of the majority alone.
@example((make_labels(30, 10, 1), 4, 1, 2, 1, 0, 0, [2]))
# A row count rounded up to a multiple of the ranks left micro-batches of 1 example.
@example((make_labels(10, 5, 2), 2, 1, 2, 2, 0, 0, [1]))
# (Its name is cited by docs/status.md: each unconsumed example is used at least once.)
def test_resume_on_another_layout_uses_each_unconsumed_example_once(setup) -> None:
    labels, m_old, r_old, m_new, r_new, seed, epoch, positions = setup
    plan = MixedLabelBatchSampler(labels, m_old, r_old, seed=seed).plan(epoch)
    consumed = [i for rank, p in enumerate(positions) for row in plan[rank::r_old][:p] for i in row]
    remaining = Counter(plan.ravel().tolist()) - Counter(consumed)
    states = _old_run_states(labels, m_old, r_old, seed, epoch, positions)
    if 0 < sum(remaining.values()) < r_new:
        with pytest.raises(ValueError, match="fewer than"):
            _resumed(labels, m_new, r_new, seed, states)
        return
    ranks = _resumed(labels, m_new, r_new, seed, states)
    assert len({len(batches) for batches in ranks}) == 1  # every rank steps the same number of times
    batches = [b for rank_batches in ranks for b in rank_batches]
    used = Counter(i for b in batches for i in b)
    assert not remaining - used  # each unconsumed example at least once
    sizes = [len(b) for b in batches]
    assert not sizes or (min(sizes) >= 2 and max(sizes) <= m_new and max(sizes) - min(sizes) <= 1)
    assert all(len({bool(labels[i]) for i in b}) == 2 for b in batches)  # every micro-batch mixed
    # A label repeats only when fewer of its examples remain than micro-batches (then it fills exactly one slot
    # of each), and its uses end as even as the remaining ones allow.
    for label in (True, False):
        left = {i: c for i, c in remaining.items() if labels[i] == label}
        got = {i: used[i] for i in left}
        assert sum(used[i] for i in used if labels[i] == label) == max(
            sum(left.values()), len(batches) * bool(left)
        )
        assert set(got) == {i for i in used if labels[i] == label}
        if sum(left.values()) < len(batches):
            spread = max(left.values()) - min(left.values())
            assert max(got.values()) - min(got.values()) <= max(1, spread)
    # The fewest micro-batches that fit: any fewer would overfill one, or leave one without the minority.
    n_major = max(
        sum(1 for i in remaining.elements() if labels[i]),
        sum(1 for i in remaining.elements() if not labels[i]),
    )
    fewer = len(batches) - r_new
    assert fewer * m_new < sum(remaining.values()) or fewer * (m_new - 1) < n_major
    # No example twice in one micro-batch unless it repeats more often than there are micro-batches.
    for b in batches:
        assert all(c <= max(1, -(-used[i] // len(batches))) for i, c in Counter(b).items())


def test_resume_with_a_smaller_micro_batch_repeats_the_minority_as_a_fresh_epoch_does() -> None:
    """746:254, micro-batch 4 on 1 rank, saved after 10 steps, resumed at micro-batch 2: the 244 undesirable
    examples left are fewer than the 716 micro-batches the 716 desirable ones need, so they repeat evenly."""
    labels = make_labels(746, 254, seed=0)
    states = _old_run_states(labels, 4, 1, seed=42, epoch=0, positions=[10])
    plan = MixedLabelBatchSampler(labels, 4, 1, seed=42).plan(0)
    remaining = Counter(plan[10:].ravel().tolist())
    (batches,) = _resumed(labels, 2, 1, 42, states)
    assert sum(1 for b in batches if len(set(labels[b].tolist())) < 2) == 0  # was 236 of 480
    n_major = sum(c for i, c in remaining.items() if labels[i])
    assert len(batches) == n_major and all(len(b) == 2 for b in batches)
    used = Counter(i for b in batches for i in b)
    assert not remaining - used
    minority_uses = [c for i, c in used.items() if not labels[i]]
    assert max(minority_uses) - min(minority_uses) <= 1
    # A second resume inside the re-planned epoch (again at micro-batch 2) goes on with the same micro-batches.
    resumed = MixedLabelBatchSampler(labels, 2, 1, seed=42)
    resumed.load_state_dicts(states)
    first = [next(it) for it in [iter(resumed)] for _ in range(5)]
    again = MixedLabelBatchSampler(labels, 2, 1, seed=42)
    again.load_state_dicts([resumed.state_dict()])
    assert first == batches[:5] and list(again) == batches[5:]


def test_resume_on_more_ranks_keeps_two_examples_of_both_labels_in_every_micro_batch() -> None:
    """10:5 at micro-batch 2 on 1 rank, 1 step done, resumed on 2 ranks: 18 slots left need 10 micro-batches
    (a multiple of 2), so sizes of 2 take 20 slots; the 2 spare ones repeat an example (they were rows of 1)."""
    labels = make_labels(10, 5, 2)
    states = _old_run_states(labels, 2, 1, seed=0, epoch=0, positions=[1])
    batches = [b for rank in _resumed(labels, 2, 2, 0, states) for b in rank]
    assert len(batches) == 10 and [len(b) for b in batches] == [2] * 10
    assert all(len(set(labels[b].tolist())) == 2 and len(set(b)) == 2 for b in batches)


def test_spreading_copies_skips_a_replan_where_no_example_repeats(monkeypatch) -> None:
    """No example twice in the whole re-plan: no row can hold one twice, so no row is searched (that per-row
    search was 12.6 s of a 17.7 s resume of 1M examples)."""
    from coati_kto.data import replan

    plan = list(np.arange(4000).reshape(1000, 4))
    calls = []
    unique = np.unique
    monkeypatch.setattr(replan.np, "unique", lambda *a, **k: calls.append(1) or unique(*a, **k))
    replan._spread_duplicates(plan, np.arange(4000) % 2 == 0)
    assert len(calls) <= 1 and np.array_equal(np.concatenate(plan), np.arange(4000))


def test_resume_on_one_rank_after_two_and_again_on_three() -> None:
    labels = make_labels(40, 24, seed=3)
    states = _old_run_states(labels, 4, 2, seed=5, epoch=1, positions=[3, 3])
    plan = MixedLabelBatchSampler(labels, 4, 2, seed=5).plan(1)
    one = MixedLabelBatchSampler(labels, 4, 1, seed=5)
    one.load_state_dicts(states)
    one.set_epoch(1)
    assert one.start == 0 and len(one) == len(plan) - 6
    first_two = [next(iter_one) for iter_one in [iter(one)] for _ in range(2)]
    # Interrupted again after 2 micro-batches of the re-planned epoch: its state knows where its plan came from.
    state = {**one.state_dict(), "position": 2}
    assert state["replanned_from"][0]["num_replicas"] == 2
    again = _resumed(labels, 4, 3, 5, [state])
    used = Counter(i for row in plan[:6] for i in row) + Counter(i for b in first_two for i in b)
    used += Counter(i for batches in again for b in batches for i in b)
    assert used == Counter(plan.ravel().tolist())
    # The same layout resumes the re-planned epoch at its position; the next epoch is this layout's own plan.
    same = MixedLabelBatchSampler(labels, 4, 1, seed=5)
    same.load_state_dicts([state])
    same.set_epoch(1)
    assert same.start == 2 and list(same) == list(iter(one))[2:]
    same.set_epoch(2)
    assert np.array_equal(np.array(list(same)), MixedLabelBatchSampler(labels, 4, 1, seed=5).plan(2))


def test_states_of_another_dataset_are_refused() -> None:
    labels = make_labels(40, 24)
    states = _old_run_states(labels, 4, 2, seed=5, epoch=0, positions=[1, 1])
    with pytest.raises(ValueError, match="dataset_size="):
        MixedLabelBatchSampler(make_labels(40, 25), 4, 1).load_state_dicts(states)
    with pytest.raises(ValueError, match="not one run"):
        MixedLabelBatchSampler(labels, 4, 1).load_state_dicts(states[:1])
