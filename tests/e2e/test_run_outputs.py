"""What a 1-process ``coati-kto train`` run writes and prints, read back from its files and captured output:
the step-0 baseline and explicit epoch-end evaluation in TensorBoard, the raw KL estimate, a first warmup step
with lr above 0, the resolved config and data statistics as TensorBoard text and hparams, the model card
final/README.md, and a log without ColossalAI's dp=1 ZeRO warning or progress lines fused with eval lines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli
from coati_kto.testing.tensorboard import read_hparams, read_scalars, read_texts

LR, WARMUP = 5e-3, 2


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("run_outputs")
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(preference_records(7, 100), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 24,  # short: some completions are truncated, so the card's truncation is not 0
            "max_prompt_length": 16,
        },
        "train": {
            "micro_batch_size": 4,
            "max_steps": 4,
            "lr": LR,
            "warmup_steps": WARMUP,
            "eval_interval": 3,
            "eval_at_epoch_end": False,  # the run ends at step 4: no evaluation there
        },
        # ZeRO-2 on one process: ColossalAI's "Use Zero Optimizer when data parallel size is 1" case.
        "plugin": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
        "output": {"dir": str(root / "out")},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    # `python -m coati_kto train` on a worker rank (coati_kto.testing.cli): the CLI's code path is all this file
    # reads. Output captured into a file: not a terminal, as in SLURM / CI / colossalai run logs; stderr merged
    # into stdout in the order written, as through one pipe.
    proc = run_cli(["train", str(path)], merge_stderr=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    out = root / "out"
    return {"out": out, "log": proc.stdout, "tb": read_scalars(out / "tensorboard"), "config": config}


def test_baseline_explicit_epoch_end_raw_kl_and_first_lr(run: dict) -> None:
    tb = run["tb"]
    assert [s for s, _ in tb["eval/loss"]] == [0, 3]  # step 0, every 3 steps; no epoch-end evaluation
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4]
    # Policy == reference before the first update: the baseline's rewards are 0, up to bf16 rounding (the
    # boosted policy and the plain reference run different bf16 kernels: about 3e-4 measured here).
    assert dict(tb["eval/rewards/margins"])[0] == pytest.approx(0.0, abs=5e-3)
    # z0 = max(0, raw KL): the raw estimate is logged beside it at every step.
    for (step, z0), (step_raw, raw) in zip(tb["train/kl"], tb["train/kl_raw"], strict=True):
        assert step == step_raw and z0 == pytest.approx(max(0.0, raw), abs=1e-6)
    # Warmup over 2 steps from above 0: lr/3, 2 lr/3, then the full lr.
    lrs = [v for _, v in tb["train/lr"]]
    assert lrs[:3] == pytest.approx([LR / 3, 2 * LR / 3, LR], rel=1e-6)


def test_tensorboard_text_and_hparams_say_what_the_run_was(run: dict) -> None:
    out = run["out"]
    texts = read_texts(out / "tensorboard")
    assert set(texts) == {"run/config", "run/data"}
    (step, config_md), *_ = texts["run/config"]
    assert step == 0
    # The text is the resolved config (defaults included) as an indented code block.
    shown = yaml.safe_load("\n".join(line[4:] for line in config_md.splitlines()))
    assert shown == yaml.safe_load((out / "config.yaml").read_text())
    assert shown["kto"]["loss_type"] == "kto" and shown["train"]["eval_at_start"] is True
    stats = json.loads((Path(run["config"]["data"]["prepared_dir"]) / "stats.json").read_text())
    data_md = texts["run/data"][0][1]
    train = stats["train"]
    row = (
        f"| train | {train['examples']} | {train['labels']['desirable']} | {train['labels']['undesirable']} | "
        f"{train['truncated']['prompt']} | {train['truncated']['completion']} | "
        f"{train['truncated']['kl_prompt']} / {train['truncated']['kl_completion']} | 0 |"
    )
    assert row in data_md.splitlines(), data_md
    assert run["config"]["data"]["train_files"][0] in data_md
    hparams = read_hparams(out / "tensorboard")
    assert hparams["train.lr"] == pytest.approx(LR) and hparams["kto.loss_type"] == "kto"
    assert hparams["plugin.zero_stage"] == 2 and hparams["train.max_steps"] == 4


def test_model_card_parses_and_holds_the_final_eval_metrics(run: dict) -> None:
    from huggingface_hub import ModelCard

    card = ModelCard.load(run["out"] / "final" / "README.md")
    assert card.data.library_name == "transformers"
    assert {"kto", "coati-kto"} <= set(card.data.tags)
    assert card.data.base_model is None  # a local directory is no Hub id: named in the text instead
    assert f"`{run['config']['model']['path']}`" in card.text
    match = re.search(r"at optimizer step (\d+):", card.text)
    assert match and int(match[1]) == 3  # the last evaluation of the run
    table = dict(re.findall(r"^\| (eval/[\w/]+) \| (\S+) \|$", card.text, flags=re.M))
    assert {"eval/loss", "eval/rewards/margins", "eval/kl", "eval/count/chosen"} <= set(table)
    for key, value in table.items():
        assert float(value) == pytest.approx(dict(run["tb"][key])[3], rel=1e-6, abs=1e-7), key
    stats = json.loads((Path(run["config"]["data"]["prepared_dir"]) / "stats.json").read_text())
    assert stats["train"]["truncated"]["completion"] > 0
    assert f"| {stats['train']['truncated']['completion']} |" in card.text
    assert "| beta | 0.1 |" in card.text and "| loss_type | kto |" in card.text


def test_log_has_no_dp1_zero_warning_and_no_fused_progress_lines(run: dict) -> None:
    log = run["log"]
    assert "Use Zero Optimizer" not in log
    lines = log.splitlines()
    evals = [line for line in lines if "eval loss" in line]
    assert evals and all(re.fullmatch(r"step \d+: eval loss \d+\.\d{4}", line) for line in evals), evals
    progress = [line for line in lines if "train step" in line]
    assert progress and all(re.fullmatch(r"train step \d+/4: loss .*", line) for line in progress), progress
    assert "train step 4/4" in progress[-1]  # the last step always gets its line


def test_the_data_summary_and_the_kto_weights_are_printed_once(run: dict) -> None:
    """A train that prepared its data printed the weights twice: in prepare's summary (its one-replica view) and
    as the run's (its layout)."""
    lines = run["log"].splitlines()
    assert sum(line.startswith(f"prepared {run['out'].parent / 'prepared'}") for line in lines) == 1
    assert sum("kto weights" in line for line in lines) == 1


def test_only_the_known_notices_are_dropped() -> None:
    """ColossalAI's dp-1 ZeRO warning and LoRA banner (its DistributedLogger), peft's read of a deprecated
    transformers property (a FutureWarning); any other warning still shows."""
    import logging
    import warnings

    from colossalai.logging import get_dist_logger

    from coati_kto.parallel.upstream.noise import quiet_known_logs, quiet_known_warnings

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    quiet_known_logs()
    quiet_known_logs()  # idempotent: one wrapper, not two
    logger, records = get_dist_logger(), Records()
    logging.getLogger("colossalai").addHandler(records)
    try:
        logger.warning("Use Zero Optimizer when data parallel size is 1 may introduce unnecessary overhead.")
        logger.warning("You have enabled LoRa training. Please check the hyperparameters such as lr")
        logger.warning("a warning that still shows")
    finally:
        logging.getLogger("colossalai").removeHandler(records)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        quiet_known_warnings()
        deprecated = (
            "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_"
        )
        warnings.warn(deprecated + "checkpointing` instead.", FutureWarning, stacklevel=1)
        warnings.warn("`is_training` is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["`is_training` is deprecated"]
    # Upstream's two records for the kept warning: the caller's location, then the message.
    assert len(records.messages) == 2, records.messages
    assert records.messages[0].startswith(f"{__file__}:") and records.messages[0].endswith(
        " test_only_the_known_notices_are_dropped"
    )
    assert records.messages[1] == "a warning that still shows"
