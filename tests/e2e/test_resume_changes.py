"""A resume with a changed config (issue 17): changed settings are named in one line and applied (a new
train.lr becomes the schedule's peak, as config.yaml and the model card say); settings that would make the
checkpoint another run's are refused in one line each, exit 2, nothing trained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from helpers import preference_records, weights

from coati_kto.data.files import write_jsonl
from coati_kto.runtime.run_dir import saved_trainer_state
from coati_kto.testing.cli import CliResult, run_cli
from coati_kto.testing.tensorboard import read_scalars, read_texts
from coati_kto.trainer.schedule import lr_factor

WARMUP, MIN_LR_RATIO = 1, 0.1


def _train(config: Path, *overrides: str) -> CliResult:
    """``coati-kto train CONFIG OVERRIDES`` on a worker rank (coati_kto.testing.cli): every test here is about what
    the CLI's code path says and does with a checkpoint on disk (settings named, applied or refused, the plan and
    schedule of the resumed run); none compares weights with an uninterrupted run, the case that needs a new
    process reading everything from disk (tests/e2e/test_operations.py)."""
    return run_cli(["train", str(config), *overrides])


def _resume_with_edited_data(config: Path) -> CliResult:
    """``train.resume=auto`` with every completion of train.jsonl edited in place (restored after)."""
    train = config.parent / "train.jsonl"
    original = train.read_text()
    try:
        train.write_text(original.replace('"completion": "', '"completion": "Edited: '))
        return _train(config, "train.resume=auto", "train.max_steps=100")  # past every test's checkpoint here
    finally:
        train.write_text(original)


def _ddp_config(root: Path, model_dir: Path, **train: float) -> Path:
    """``root/config.yaml``: 24 examples, ddp fp32, micro-batch 4, lr 1e-3 (and ``train``), a checkpoint every 2
    steps in ``root/out``."""
    config = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), root / "train.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
        },
        "train": {"micro_batch_size": 4, "lr": 1e-3, **train},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(root / "out"), "save_interval": 2},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def first_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume_changes")
    path = _ddp_config(root, tiny_model_dir, max_steps=4, warmup_steps=WARMUP, min_lr_ratio=MIN_LR_RATIO)
    done = _train(path)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_a_changed_micro_batch_size_replans_the_epoch_in_progress(first_run: Path) -> None:
    """The checkpoint at step 4 consumed 16 of the epoch's 24 examples in micro-batches of 4. Resumed with
    micro-batches of 8 over 2 epochs, the other 8 examples are step 5 (the rest of epoch 0 re-planned), and epoch
    1 runs in micro-batches of 8; the schedule spans the 8 steps the run now holds. The resume used to say
    "applied" and then refuse the changed micro-batch size at the first step."""
    checkpoint, out = first_run.parent / "out" / "checkpoints" / "step-4", first_run.parent / "resized"
    overrides = (f"output.dir={out}", "train.micro_batch_size=8", "train.max_epochs=2", "train.max_steps=100")
    done = _train(first_run, f"train.resume={checkpoint}", *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0] == (
        f"resuming from {checkpoint} (train.resume); to start over instead, leave train.resume unset"
    )
    assert (
        "resume: 3 setting(s) differ from step-4's config, applied: train.max_epochs 1 -> 2, "
        "train.max_steps 4 -> 100, train.micro_batch_size 4 -> 8"
    ) in done.stdout.splitlines()
    assert (
        "note: train.max_epochs 2 holds 8 optimizer steps, fewer than train.max_steps 100: the run ends after 8"
        in (done.stdout.splitlines())
    )
    scalars = read_scalars(out / "tensorboard")
    examples = [
        c + r
        for (_, c), (_, r) in zip(scalars["train/count/chosen"], scalars["train/count/rejected"], strict=True)
    ]
    assert [step for step, _ in scalars["train/loss"]] == [5, 6, 7, 8]
    assert examples == [8, 8, 8, 8]  # 24 examples an epoch: the last 8 of epoch 0, then 3 steps of epoch 1
    lrs = dict(scalars["train/lr"])
    for step in (5, 6, 7, 8):
        assert lrs[step] == pytest.approx(1e-3 * lr_factor(step - 1, WARMUP, 8, MIN_LR_RATIO), rel=1e-6)


def test_changed_lr_is_applied_named_and_recorded(first_run: Path) -> None:
    done = _train(first_run, "train.resume=auto", "train.max_steps=6", "train.lr=5e-4")
    assert done.returncode == 0, done.stderr[-3000:]
    out = first_run.parent / "out"
    # The rerun of a config that continues its run says so first, and how to start over (it was silent).
    assert done.stdout.splitlines()[0] == (
        f"resuming the run in {out} from step-4 (train.resume=auto); to start over instead, add "
        "output.overwrite=true (deletes its checkpoints, events, final model and exports) or choose another output.dir"
    )
    line = (
        "resume: 2 setting(s) differ from step-4's config, applied: train.lr 0.001 -> 0.0005, "
        "train.max_steps 4 -> 6"
    )
    assert line in done.stdout.splitlines()
    lrs = dict(read_scalars(out / "tensorboard")["train/lr"])
    # Steps 1-4 at the old peak over 4 steps; steps 5-6 at the new peak over the new length (6 steps).
    assert lrs[4] == pytest.approx(1e-3 * lr_factor(3, WARMUP, 4, MIN_LR_RATIO), rel=1e-6)
    assert lrs[5] == pytest.approx(5e-4 * lr_factor(4, WARMUP, 6, MIN_LR_RATIO), rel=1e-6)
    assert lrs[6] == pytest.approx(5e-4 * lr_factor(5, WARMUP, 6, MIN_LR_RATIO), rel=1e-6)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 5e-4
    assert f"- {line}" in (out / "final" / "README.md").read_text()


def test_a_change_that_makes_another_run_is_refused(first_run: Path) -> None:
    out = first_run.parent / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    done = _train(first_run, "train.resume=auto", "train.seed=3", "train.max_steps=8")
    assert done.returncode == 2, done.stderr[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [
        f"error: train.resume {latest}: train.seed 42 -> 3: cannot change on resume (the data order of the "
        "epoch in progress depends on it)",
        "(start a new run in another output.dir, or resume unchanged)",
    ]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing trained, nothing saved


def test_a_change_of_the_optimizers_groups_is_refused(first_run: Path) -> None:
    """weight_decay 0 -> 0.1 puts biases and norm weights in a group of their own (transformers' rule): the saved
    optimizer state is by group, so the resume is refused in one line, before anything loads."""
    out = first_run.parent / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    done = _train(first_run, "train.resume=auto", "train.weight_decay=0.1", "train.max_steps=100")
    assert done.returncode == 2, done.stderr[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [
        f"error: train.resume {latest}: its optimizer holds the parameters in one group (train.weight_decay 0, "
        "train.decay_norms_and_biases true, or model.lora); this config would hold them in biases and norm weights "
        "in a group of their own (train.weight_decay > 0, train.decay_norms_and_biases false): resume with the "
        "checkpoint's grouping, or start a new run"
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    applied = _train(first_run, "train.resume=auto", "train.weight_decay=0.1", "train.decay_norms_and_biases=true",
                     "train.max_steps=100")  # fmt: skip
    assert applied.returncode == 0, applied.stderr[-3000:]  # one group: the decay rate itself may change


def test_training_data_edited_in_place_is_refused(first_run: Path) -> None:
    """The same train file, edited (completions rewritten, as many records and labels): the config is unchanged,
    so the resume was accepted and the epoch in progress went on at its old position in other rows. The refusal
    names the file (it said "the content of data.train_files or the tokenizer")."""
    import re

    out = first_run.parent / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    done = _resume_with_edited_data(first_run)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    latest, train = (out / "checkpoints" / "latest").read_text().strip(), first_run.parent / "train.jsonl"
    assert re.fullmatch(
        rf"error: train.resume {latest}: the training data changed since the checkpoint \({re.escape(str(train))}'s "
        r"content: [0-9a-f]{16} -> [0-9a-f]{16}\): cannot change on resume \(the data "
        r"position of the epoch in progress belongs to the old training set\)",
        errors[0],
    ), errors
    assert errors[1:] == ["(start a new run in another output.dir, or resume unchanged)"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing trained, nothing saved


def test_reference_weights_saved_over_in_place_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same model.path, its weights saved over (a new SFT run into the same directory: same shapes, same
    file size): the resume was accepted and the online reference scored the rest of the run with the new
    weights, in silence (step 3's KL estimate went from 3.4 to 18.4 on this fixture)."""
    import re
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "sft")  # saved over below: not the shared one
    path = _ddp_config(tmp_path, model_dir, max_steps=2)
    assert (done := _train(path)).returncode == 0, done.stderr[-3000:]
    unchanged = _train(path, "train.resume=auto", "train.max_steps=3", f"output.dir={tmp_path / 'unchanged'}")
    assert unchanged.returncode == 0, unchanged.stderr[-3000:]  # the same weights: resumed
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    model.save_pretrained(model_dir)
    done = _train(path, "train.resume=auto", "train.max_steps=3")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert re.fullmatch(
        r"error: train.resume step-2: the reference model's weights changed since the checkpoint \(the files "
        r"under model.reference_path / model.path: [0-9a-f]{16} -> [0-9a-f]{16}\): cannot change on resume "
        r"\(the rewards so far were measured against another reference\)",
        errors[0],
    ), errors
    assert errors[1:] == ["(start a new run in another output.dir, or restore the weights)"]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["latest", "step-2"]


def test_lora_online_reference_is_the_checkpoints_base_not_the_disks(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """model.lora with an online reference: the reference is the policy with its adapters off, and a checkpoint
    holds the frozen base weights with the adapters, so a resume restores the base the rewards were measured
    against. Weights saved over model.path since are neither read nor refused (reference_weights_digest is None
    there): steps 3 and 4 resumed from step 2 equal the uninterrupted run's, which the saved-over base (every
    matrix x 1.5) would not give as a reference."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "sft")  # saved over below: not the shared one
    path = _ddp_config(tmp_path, model_dir, max_steps=4, lr=3e-2)
    lora = "model.lora={rank: 4, alpha: 8}"
    assert (whole := _train(path, lora)).returncode == 0, whole.stderr[-3000:]
    original = load_file(model_dir / "model.safetensors")
    saved_over = {k: v * 1.5 if v.dim() == 2 else v for k, v in original.items()}
    save_file(saved_over, model_dir / "model.safetensors", metadata={"format": "pt"})
    step2, resumed = tmp_path / "out" / "checkpoints" / "step-2", tmp_path / "resumed"
    done = _train(path, lora, f"train.resume={step2}", f"output.dir={resumed}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [line for line in done.stdout.splitlines() if line.startswith("resume: ")]  # nothing differs
    saved = load_file(next((step2 / "model").glob("*.safetensors")))
    assert torch.equal(saved["lm_head.weight"], original["lm_head.weight"])  # the base the resume restores
    before, after = read_scalars(tmp_path / "out" / "tensorboard"), read_scalars(resumed / "tensorboard")
    for tag in ("train/loss", "train/kl", "train/rewards/chosen", "train/rewards/margins"):
        assert after[tag] == [(s, v) for s, v in before[tag] if s > 2], tag
    assert before["train/kl"][2][1] > 0  # step 3: the adapters are on, the comparison is not of zeros


def test_a_resume_refused_for_edited_data_leaves_the_prepared_data_alone(first_run: Path) -> None:
    """The refusal above came only after setup: data.prepared_dir rebuilt for the edited files (the reference
    cache the checkpoint's run needs deleted with it) and, with kto.reference cached, the edited data scored with
    the reference; docs/operations.md says a refused resume is said before either."""
    prepared = first_run.parent / "prepared"
    fingerprint = (prepared / "fingerprint.json").read_text()
    kept = prepared / "reference_cache" / "kept"  # stands for the run's cached reference log-probs
    kept.mkdir(parents=True)
    done = _resume_with_edited_data(first_run)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the training data changed since the checkpoint" in done.stderr
    assert not done.stdout.startswith("prepared "), done.stdout[:300]
    assert (prepared / "fingerprint.json").read_text() == fingerprint
    assert kept.is_dir()


def test_a_resume_at_the_step_limit_does_not_evaluate_again(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The checkpoint at step 2 (the last) is written after the run's final evaluation and records it: a run
    resumed from it (a finished job submitted again with resume: auto) ends without evaluating step 2 again. It
    was saved before that evaluation, and the resumed run evaluated again (TensorBoard then held step 2 twice).
    A checkpoint written before it (a stop at the last step) still gets it on resume (KTOTrainer.fit)."""
    config = _ddp_config(tmp_path, tiny_model_dir, max_steps=2, eval_at_start=False)
    eval_file = write_jsonl(preference_records(8, 100), tmp_path / "eval.jsonl")
    whole = _train(config, f"data.eval_files=[{eval_file}]")
    assert whole.returncode == 0, whole.stderr[-3000:]
    checkpoint, out = tmp_path / "out" / "checkpoints" / "step-2", tmp_path / "at_the_end"
    assert saved_trainer_state(checkpoint)["trainer_state"]["last_eval_step"] == 2
    done = _train(config, f"data.eval_files=[{eval_file}]", f"train.resume={checkpoint}", f"output.dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [step for step, _ in read_scalars(tmp_path / "out" / "tensorboard")["eval/loss"]] == [2]
    assert "eval/loss" not in read_scalars(out / "tensorboard")
    resumed, whole_weights = weights(out), weights(tmp_path / "out")
    assert resumed.keys() == whole_weights.keys() and all(
        torch.equal(resumed[k], whole_weights[k]) for k in resumed
    )


def test_a_limit_the_checkpoint_is_already_past_is_refused(first_run: Path, tmp_path: Path) -> None:
    """From an audit: resuming step-4 with train.max_steps 3 said "applied: train.max_steps 4 -> 3", trained
    nothing and wrote final/ from step 4's weights; a max_epochs the checkpoint's epoch is past likewise, with no
    note at all. Refused in one line before anything heavy (at the limit is a resume that finishes)."""
    from coati_kto.runtime.resume_checks import _limit_passed

    checkpoint = first_run.parent / "out" / "checkpoints" / "step-4"
    done = _train(
        first_run, f"train.resume={checkpoint}", "train.max_steps=3", f"output.dir={tmp_path / 'x'}"
    )
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: train.resume step-4: train.max_steps 3 is below its step 4: the resumed run would train nothing; "
        "raise the limit, or export the checkpoint as it is (coati-kto export CONFIG)"
    ]
    assert not (tmp_path / "x").exists()
    state = {"global_step": 14, "epoch": 1}
    assert _limit_passed(state, {"max_steps": 14, "max_epochs": 2}, "step-14") is None
    assert _limit_passed(state, {"max_steps": None, "max_epochs": 1}, "step-14") == (
        "train.resume step-14: train.max_epochs 1 ends before its epoch 2: the resumed run would train nothing; "
        "raise the limit, or export the checkpoint as it is (coati-kto export CONFIG)"
    )


def test_a_logging_interval_open_at_the_checkpoint_logs_as_uninterrupted(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """train.log_interval 4 with a checkpoint at step 5, in a run of 6 steps (its epoch): a run resumed from it logs
    the last record, step 6's, over steps 5-6 as the uninterrupted run did. It began an empty interval: step 5
    was in no record."""
    config = _ddp_config(tmp_path, tiny_model_dir, max_steps=6, log_interval=4)
    whole = _train(config, "output.save_interval=5")
    assert whole.returncode == 0, whole.stderr[-3000:]
    checkpoint, out = tmp_path / "out" / "checkpoints" / "step-5", tmp_path / "resumed"
    done = _train(config, "output.save_interval=5", f"train.resume={checkpoint}", f"output.dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    logged, resumed = read_scalars(tmp_path / "out" / "tensorboard"), read_scalars(out / "tensorboard")
    assert [step for step, _ in logged["train/loss"]] == [4, 6]
    assert [step for step, _ in resumed["train/loss"]] == [6]
    for tag in ("train/loss", "train/rewards/chosen", "train/count/chosen", "train/kl"):
        assert resumed[tag] == [(6, dict(logged[tag])[6])], tag


def test_each_step_is_logged_once_however_often_a_checkpoint_is_resumed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """From an audit: a resume evaluates at its checkpoint's step when that step was not evaluated, and TensorBoard
    purged only the steps after the checkpoint's. So each resume of one checkpoint (a requeued job that dies before
    its next save) added one more eval point at that step, and one more run/config and run/data text. Two resumes
    of step-2 into the run's own directory: every step's points once, the last resume's."""
    config = _ddp_config(tmp_path, tiny_model_dir, max_steps=4, eval_interval=4)
    held_out = write_jsonl(preference_records(8, 50), tmp_path / "eval.jsonl")
    evaluate = f"data.eval_files=[{held_out}]"
    assert _train(config, evaluate).returncode == 0
    step2, tensorboard = tmp_path / "out" / "checkpoints" / "step-2", tmp_path / "out" / "tensorboard"
    first = read_scalars(tensorboard)
    assert [step for step, _ in first["eval/loss"]] == [0, 4]
    for _ in range(2):
        done = _train(config, evaluate, f"train.resume={step2}")
        assert done.returncode == 0, done.stderr[-3000:]
    logged = read_scalars(tensorboard)
    assert [step for step, _ in logged["eval/loss"]] == [0, 2, 4]  # step 2: the resume's evaluation, once
    assert [step for step, _ in logged["train/loss"]] == [1, 2, 3, 4]
    assert logged["train/loss"][:2] == first["train/loss"][:2]  # the steps before the checkpoint's, untouched
    texts = read_texts(tensorboard)
    assert [step for step, _ in texts["run/config"]] == [step for step, _ in texts["run/data"]] == [0, 2]


def test_a_changed_logging_interval_logs_the_open_one_apart(tiny_model_dir: Path, tmp_path: Path) -> None:
    """From an audit: resumed at step 2 of a log_interval 3 run with log_interval 1, step 3's record averaged steps
    1-3. The open interval is now a record of its own at the checkpoint's step, and each later step's record is an
    uninterrupted log_interval 1 run's."""
    config = _ddp_config(tmp_path, tiny_model_dir, max_steps=4, log_interval=3)
    assert _train(config).returncode == 0
    every = _train(config, "train.log_interval=1", f"output.dir={tmp_path / 'every'}")
    assert every.returncode == 0
    step2 = tmp_path / "out" / "checkpoints" / "step-2"
    done = _train(config, f"train.resume={step2}", "train.log_interval=1")
    assert done.returncode == 0, done.stderr[-3000:]
    logged, whole = (
        read_scalars(tmp_path / "out" / "tensorboard"),
        read_scalars(tmp_path / "every" / "tensorboard"),
    )
    assert [step for step, _ in logged["train/loss"]] == [2, 3, 4]
    for tag in ("train/loss", "train/kl", "train/count/chosen", "train/rewards/margins"):
        assert logged[tag][1:] == whole[tag][2:], tag
    counts = dict(logged["train/count/chosen"])[2] + dict(logged["train/count/rejected"])[2]
    assert counts == sum(dict(whole[f"train/count/{k}"])[s] for k in ("chosen", "rejected") for s in (1, 2))


def test_a_changed_weight_decay_is_used_after_the_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    """From an audit: the optimizer's loaders copy each saved group's settings back, so a resume at another
    train.weight_decay was named as applied (and recorded in config.yaml and the card) but trained at the old
    one: the weights came out bit for bit those of an unchanged resume. Two resumes of one checkpoint at 0.1 and
    5.0: the norm weights (weight decay 0 in both) equal, every decayed tensor apart."""
    path = _ddp_config(tmp_path, tiny_model_dir, max_steps=2, weight_decay=0.1)
    first = _train(path, "output.save_interval=1")
    assert first.returncode == 0, first.stderr[-3000:]
    step1 = tmp_path / "out" / "checkpoints" / "step-1"
    finals = {}
    for decay in (0.1, 5.0):
        out = tmp_path / f"decay_{decay}"
        done = _train(path, f"train.resume={step1}", f"output.dir={out}", f"train.weight_decay={decay}")
        assert done.returncode == 0, done.stderr[-3000:]
        finals[decay] = weights(out)
    kept, decayed = finals[0.1], finals[5.0]
    assert kept.keys() == decayed.keys()
    for name in kept:
        same = torch.equal(kept[name], decayed[name])
        assert same == ("norm" in name), name
