"""The learning rate on a step the fp16 loss scaler skips: held, as transformers' Trainer holds it.

Before, the schedule advanced on every optimizer step, the scaler's skipped ones included. ColossalAI's ZeRO
scaler starts at 2**32 and backs off through its first ~18 steps: a warmup of 10 steps was spent on no update,
and the first real update ran at about 98% of the peak. Now the schedule moves only on steps that update (and on
a non-finite skip, as before). The fp16 trainer path runs on a GPU only: ``KTOTrainer._train_step`` runs here
with its collaborators stubbed and the loss scaler's verdict given.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coati_kto.trainer import kto
from coati_kto.trainer.kto import KTOTrainer
from coati_kto.trainer.schedule import lr_factor, warmup_decay_schedule

WARMUP, TOTAL, SKIPPED = 4, 20, 3


def _trainer(verdicts: list[bool], monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    monkeypatch.setattr(kto, "reduce_sums", lambda local, *args: {"nonfinite": 0.0, kto._GRAD_SQ: 1.0})
    monkeypatch.setattr(kto, "skipped_by_loss_scaler", lambda optimizer: verdicts.pop(0))
    monkeypatch.setattr(kto, "summarize", lambda totals, kl: {})
    monkeypatch.setattr(kto, "decide", lambda totals: None)
    monkeypatch.setattr(kto, "compile_metrics", lambda policy: {})
    return SimpleNamespace(
        global_step=0,
        options=SimpleNamespace(kl_scope="step", on_nonfinite="skip", log_interval=10**6),
        device=torch.device("cpu"),
        pipeline=None,
        passes=SimpleNamespace(train_step=lambda groups, sums: iter(())),
        _grad_norm=SimpleNamespace(
            local_share=lambda: torch.tensor(1.0), loss_scaled=True, unscaled=lambda n: n, step=lambda n: None
        ),
        layout=SimpleNamespace(sums_group=lambda: (None, True), is_main=True),
        stop_signals=SimpleNamespace(vote=lambda: {}),
        optimizer=optimizer,
        lr_scheduler=warmup_decay_schedule(optimizer, WARMUP, TOTAL, 0.0),
        position=SimpleNamespace(consumed=0),
        policy=None,
        _interval=SimpleNamespace(add=lambda *args, **kwargs: None, skip=lambda seconds: None),
        _progress=None,
        skipped_steps=0,
    )


def test_the_schedule_holds_on_the_loss_scalers_skipped_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    verdicts = [True] * SKIPPED + [False] * (WARMUP + 2)
    trainer = _trainer(list(verdicts), monkeypatch)
    logged = []
    for _ in verdicts:
        KTOTrainer._train_step(trainer, [], epoch=0)
        logged.append(trainer._last_lr)
    expected = [lr_factor(0, WARMUP, TOTAL, 0.0)] * (SKIPPED + 1)  # held, then the first real update
    expected += [lr_factor(k, WARMUP, TOTAL, 0.0) for k in range(1, WARMUP + 2)]
    assert logged == pytest.approx(expected, rel=1e-12)
    assert trainer.skipped_steps == SKIPPED and trainer.lr_scheduler.last_epoch == WARMUP + 2
