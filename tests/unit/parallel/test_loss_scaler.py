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
