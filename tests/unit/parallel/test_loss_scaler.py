"""The fp16 loss scaler through a checkpoint (``optimizer_path.loss_scaler_state`` / ``restore_loss_scaler``):
ColossalAI 0.5.0 saves none of it, so a resumed fp16 run restarted at 2**16 and skipped steps until the scale came
back down. fp16 trains on GPUs only; here the scaler itself, ColossalAI's ``DynamicGradScaler``, on the CPU."""

from __future__ import annotations

import io
from types import SimpleNamespace

import torch
from colossalai.amp.naive_amp.grad_scaler import DynamicGradScaler

from coati_kto.parallel import upstream
from coati_kto.parallel.loss_scale import loss_scale, loss_scaler_state, restore_loss_scaler

# Before the save: three backoffs (hysteresis 2) to 2**13, one clean step counted towards growth. After: two more
# clean steps grow the scale only if that count came through the checkpoint (growth interval 3).
OVERFLOWS = [False, True, True, True, False, True, False] + [False, False, True, False, False, False, False]


def _optimizer(attribute: str) -> SimpleNamespace:
    """A plugin optimizer as the functions see it: ZeRO's mixin or the AMP optimizer's, with its scaler."""
    scaler = DynamicGradScaler(initial_scale=2**16, growth_interval=3, hysteresis=2, max_scale=2**24)
    return SimpleNamespace(**{attribute: SimpleNamespace(grad_scaler=scaler, loss_scale=scaler.scale)})


def test_a_restored_scaler_continues_as_the_uninterrupted_one(monkeypatch) -> None:
    from colossalai.accelerator import get_accelerator

    upstream.apply()  # the CPU accelerator the scaler's tensors are made on
    # the scaler's constructor counts devices, which ColossalAI's CPU accelerator refuses (fp16 is GPU-only)
    monkeypatch.setattr(type(get_accelerator()), "device_count", lambda self: 1)
    for attribute in ("mixed_precision_mixin", "mixed_precision"):
        running, resumed = _optimizer(attribute), _optimizer(attribute)
        scaler = getattr(running, attribute).grad_scaler
        for overflow in OVERFLOWS[:7]:
            scaler.update(overflow)
        buffer = io.BytesIO()
        torch.save(loss_scaler_state(running), buffer)  # as in trainer_state/rank-R.pt
        buffer.seek(0)
        restore_loss_scaler(resumed, torch.load(buffer))
        again = getattr(resumed, attribute).grad_scaler
        assert float(again.scale) == float(scaler.scale) == 2**13
        # the counters came too: the same growths and backoffs after the resume
        for overflow in OVERFLOWS[7:]:
            scaler.update(overflow)
            again.update(overflow)
            assert float(again.scale) == float(scaler.scale)
        assert float(scaler.scale) != 2**13  # it moved after the resume


def test_without_fp16_there_is_nothing_to_save_or_restore() -> None:
    bf16 = SimpleNamespace(mixed_precision_mixin=SimpleNamespace())  # ZeRO's bf16 mixin: no scaler
    assert loss_scaler_state(bf16) is None and loss_scale(bf16) is None
    restore_loss_scaler(bf16, None)
    restore_loss_scaler(
        SimpleNamespace(), {"scale": torch.tensor(8.0), "growth_step": 1, "hysteresis_step": 0}
    )


class _LoadsNothing:
    """A booster whose loads do nothing: ``CheckpointManager.load``'s own reads are what is under test."""

    def load_model(self, *args) -> None: ...

    def load_optimizer(self, *args) -> None: ...

    def load_lr_scheduler(self, *args) -> None: ...


class _Boosted(torch.nn.Module):
    """A model as the booster returns it: ``unwrap()`` gives the module inside."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)

    def unwrap(self, unwrap_peft: bool = True) -> torch.nn.Module:
        return self.module


def test_a_resume_on_another_layout_keeps_the_loss_scale(tmp_path, monkeypatch) -> None:
    """The scale is the same on every rank (the overflow vote is global), so rank 0's saved scaler fits any
    layout; a 2-rank fp16 run resumed on 1 rank used to restart at the initial scale and skip steps."""
    from colossalai.accelerator import get_accelerator

    from coati_kto.parallel.distributed import ParallelLayout
    from coati_kto.trainer.checkpoint import CheckpointManager

    upstream.apply()
    monkeypatch.setattr(type(get_accelerator()), "device_count", lambda self: 1)
    saved = tmp_path / "step-4"
    (saved / "trainer_state").mkdir(parents=True)
    (saved / "meta.json").write_text('{"step": 4, "world_size": 2, "dp_size": 2, "tp_size": 1}')
    scaler = {"scale": torch.tensor(2.0**9), "growth_step": 5, "hysteresis_step": 1}
    for rank in (0, 1):
        state = {"global_step": 4, "epoch": 0, "dp_rank": rank, "consumed": 2}
        torch.save(
            {"trainer_state": state, "rng": None, "loss_scaler": scaler},
            saved / "trainer_state" / f"rank-{rank}.pt",
        )
    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, dp_group=None)
    manager = CheckpointManager(tmp_path, _LoadsNothing(), layout)
    resumed = _optimizer("mixed_precision_mixin")
    state = manager.load(saved, _Boosted(), resumed, None)
    again = resumed.mixed_precision_mixin.grad_scaler
    assert float(again.scale) == 2.0**9 and (again._growth_step, again._hysteresis_step) == (5, 1)
    assert [s["dp_rank"] for s in state["rank_states"]] == [0, 1]  # the data position, as before
