"""Whether and from where a run continues a checkpoint, said before anything heavy (coati_kto.runtime.preflight):
the problems of ``train.resume`` (a missing, damaged or refused checkpoint; output.overwrite deleting the one
named), and the run's first line, which says what it continues and how to start over instead."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from coati_kto.config.output import OutputSection
from coati_kto.config.resume import check_resume, optimizer_groups_problem
from coati_kto.config.schema import TrainSection
from coati_kto.errors import ConfigError, UserError
from coati_kto.runtime.lineage import resolve_checkpoint, resume_choice
from coati_kto.runtime.run_dir import CHECKPOINTS_DIR, complete_checkpoints, previous_run, saved_trainer_state


def starts_from_zero(train: TrainSection, output: OutputSection) -> bool:
    """No resume, or train.resume=auto with no complete checkpoint to resume from."""
    if train.resume is None:
        return True
    checkpoints = Path(output.dir) / CHECKPOINTS_DIR
    return train.resume == "auto" and not complete_checkpoints(checkpoints)


def resume_problems(train: TrainSection, output: OutputSection, current: dict) -> list[str]:
    """A checkpoint train.resume names that is not one, or is damaged, or changes from its config to ``current``
    (this run's whole config as JSON) a resume refuses: said before the data is prepared and the cached reference
    computed (a refused resume used to rebuild data.prepared_dir, deleting the reference cache the old config
    needs, and score the data with the reference, then refuse).

    The damage check (every shard's header) is the launcher's, or a lone process's: under torchrun global rank 0
    checks again once the process group exists and every rank raises its verdict (setup_training), rather than
    every rank of a large job reading every shard here."""
    if train.resume is None:
        return []
    if output.overwrite:  # auto: the run's checkpoints are deleted before auto looks for one (resume_notice)
        refusal = overwrite_refusal(train, output)
        return [refusal] if refusal else []
    root = Path(output.dir) / CHECKPOINTS_DIR
    try:
        if "RANK" in os.environ:
            checkpoint = resolve_checkpoint(root, train.resume)
        else:
            checkpoint = resume_choice(root, train.resume)[0]
    except UserError as err:
        return [str(err)]
    if checkpoint is None:
        return []
    try:
        state = saved_trainer_state(checkpoint)["trainer_state"]
        saved = state.get("config")
    except OSError:  # none saved, or pruned by a run still saving there (keep_last): the lock check says so
        return []
    if saved is None:
        return []
    try:
        check_resume(saved, current, checkpoint.name, saved_cwd=state.get("config_cwd"))
    except ConfigError as err:
        return str(err).splitlines()
    groups = optimizer_groups_problem(state, current, checkpoint.name)
    return [
        why for why in (groups, _limit_passed(state, current["train"], checkpoint.name)) if why is not None
    ]


def _limit_passed(state: dict, train: dict, checkpoint: str) -> str | None:
    """A resume whose train.max_steps or max_epochs the checkpoint is already past: it would train nothing and
    write final/ from the checkpoint's weights, after saying "applied" of the lowered limit. At the limit is
    fine (a run stopped during its end's evaluation finishes so)."""
    step, epoch = int(state.get("global_step", 0)), int(state.get("epoch", 0))
    passed = []
    if train.get("max_steps") is not None and train["max_steps"] < step:
        passed.append(f"train.max_steps {train['max_steps']} is below its step {step}")
    if train.get("max_epochs") is not None and train["max_epochs"] < epoch + 1:
        passed.append(f"train.max_epochs {train['max_epochs']} ends before its epoch {epoch + 1}")
    if not passed:
        return None
    return (
        f"train.resume {checkpoint}: {' and '.join(passed)}: the resumed run would train nothing; raise the limit, "
        "or export the checkpoint as it is (coati-kto export CONFIG)"
    )


def overwrite_refusal(train: TrainSection, output: OutputSection) -> str | None:
    """output.overwrite with train.resume naming a path inside output.dir: overwrite would delete the checkpoint
    before the resume reads it (it did: checkpoints/ and final/ gone, then "does not exist"). One line, said
    before anything is deleted; None when the pair is fine (auto starts over: resume_notice says so)."""
    resume = train.resume
    if not output.overwrite or resume is None or resume == "auto":
        return None
    out_dir, path = Path(output.dir).expanduser().resolve(), Path(resume).expanduser().resolve()
    if path != out_dir and out_dir not in path.parents:
        return None
    return (
        f"train.resume {resume} is inside output.dir {output.dir}, which output.overwrite=true deletes before "
        "the resume reads it: drop output.overwrite to continue from it, or copy the checkpoint out of "
        "output.dir first"
    )


# Set by the ``--nproc-per-node`` launcher once it printed the resume line: its workers inherit it and stay quiet.
RESUME_SAID_ENV = "COATI_KTO_RESUME_SAID"


def resume_notice(train: TrainSection, output: OutputSection) -> str | None:
    """The line a run that continues a checkpoint starts with: which one, and how to start over instead (TRL starts
    anew unless told to resume; the shipped configs' ``train.resume: auto`` continues), then a ``warning:`` line
    when auto passes over a damaged checkpoint. With output.overwrite, auto starts over: said when there is a run
    to delete. None when the run starts from step 0 in silence, or when the checkpoint named is no checkpoint
    (:func:`check_training` says so)."""
    resume = train.resume
    if resume == "auto" and output.overwrite:
        found = previous_run(Path(output.dir))
        if not found:
            return None
        return (
            f"starting over in {output.dir}: output.overwrite=true deletes its run ({', '.join(found[-3:])}) "
            "instead of continuing it (train.resume=auto); to continue it, drop output.overwrite"
        )
    if resume is None or output.overwrite:
        return None
    try:
        checkpoint, warning = resume_choice(Path(output.dir) / CHECKPOINTS_DIR, resume)
    except UserError:
        return None
    if checkpoint is None:
        return None
    if resume == "auto":
        how = (
            "to start over instead, add output.overwrite=true (deletes its checkpoints, events, final model and exports) "
            "or choose another output.dir"
        )
        line = f"resuming the run in {output.dir} from {checkpoint.name} (train.resume=auto); {how}"
        return line if warning is None else f"{line}\n{warning}"
    return f"resuming from {checkpoint} (train.resume); to start over instead, leave train.resume unset"


def announce_resume(train: TrainSection, output: OutputSection, launcher: bool = False) -> None:
    """Print :func:`resume_notice`, the run's first line, once: by the ``launcher`` (which marks it said for its
    workers), else by global rank 0. Its ``warning:`` line goes to stderr, as the run's other warnings do."""
    if os.environ.get(RESUME_SAID_ENV) or os.environ.get("RANK", "0") != "0":
        return
    line = resume_notice(train, output)
    if line is not None:
        said, _, warning = line.partition("\n")
        print(said, flush=True)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    if launcher:
        os.environ[RESUME_SAID_ENV] = "1"
