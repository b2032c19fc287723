"""Operations, through the real CLI and real processes: a stop signal ends a 2-process run with a checkpoint and
one line, and the resumed run ends with the uninterrupted run's weights; Ctrl-C twice aborts at once; one run
per output dir; bad inputs fail before anything heavy, all at once, on one line each; a checkpoint write that
fails on one rank stops every rank at once with the last complete checkpoint intact.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import env, weights, write_run

from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP_EXIT_CODE
from coati_kto.testing.cli import run_cli
from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.tensorboard import read_scalars


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "coati_kto", *args]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def read_until(proc: subprocess.Popen, prefix: str) -> str:
    """``proc``'s output up to and including its first line that starts with ``prefix``."""
    assert proc.stdout is not None
    seen = []
    while line := proc.stdout.readline():
        seen.append(line)
        if line.startswith(prefix):
            return "".join(seen)
    raise AssertionError(f"no line starting {prefix!r}: {''.join(seen)[-3000:]}")


def stop_with_sigterm(proc: subprocess.Popen, out: Path, again: bool = False) -> tuple[str, str, int]:
    """SIGTERM to ``proc`` once ``out`` holds checkpoint step-4; (output, the one stop line, its step) after the
    clean stop (exit 75). ``again``: a SIGTERM and a SIGINT more once the stop line is out, as the ranks leave."""
    wait_for(out / "checkpoints" / "step-4", proc)
    proc.send_signal(signal.SIGTERM)
    head = ""
    if again:
        head = read_until(proc, "stopped by")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    output = head + output
    assert proc.returncode == STOP_EXIT_CODE, output[-3000:]
    stopped = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1, output[-3000:]
    return output, stopped[0], int(stopped[0].split("after step ")[1].split(";")[0])


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return write_run(tmp_path_factory.mktemp("ops"), tiny_model_dir)


# 20 of the epoch's 24 steps: the stop (at step 4 or a few after) and the resume stay mid-epoch, with room for a
# late signal; the run's length adds nothing else, and each step is paid for by the reference and the final resume.
SIGNAL_STEPS = 20


def test_signals_stop_with_a_checkpoint_and_resume_exactly(run_config: Path, tmp_path: Path) -> None:
    # Records over 3 steps: the stop lands inside one (step 4's checkpoint and the SIGTERM after it)
    steps, interval = f"train.max_steps={SIGNAL_STEPS}", "train.log_interval=3"
    train = cli("train", "--nproc-per-node", "2", str(run_config), steps, interval)
    # The uninterrupted run is only the CLI's code path on 2 ranks (same code, same machine, 1 thread: the same
    # bits as a launch): on worker ranks. The signals, and the final resume that must read everything from
    # disk, are real launches.
    reference = tmp_path / "reference"
    done = run_cli(["train", str(run_config), steps, interval, f"output.dir={reference}"], 2)
    assert done.returncodes == [0, 0], done.stderr[-3000:]

    out = tmp_path / "interrupted"
    # SIGTERM to the launcher mid-epoch (as SLURM or Kubernetes send it): every rank finishes the step it is
    # in, one checkpoint, one line, exit 75. More stop signals as the ranks leave change nothing (one killed a
    # rank in its interpreter's teardown: "rank 0 failed with signal SIGTERM", exit 1).
    output, stopped, step = stop_with_sigterm(start([*train, f"output.dir={out}"]), out, again=True)
    # Mid-epoch, with room left for the resumed run's next checkpoint and the two SIGINTs before its end.
    assert 4 <= step <= SIGNAL_STEPS - 8
    assert stopped == (
        f"stopped by SIGTERM after step {step}; checkpoint {out}/checkpoints/step-{step}; "
        "resume with train.resume=auto"
    )
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
    assert "Traceback" not in output and "launcher:" not in output
    assert not (out / "final").exists()

    # Ctrl-C twice on the resumed run: abort at once, one line, nothing saved, the checkpoint still there.
    proc = start([*train, f"output.dir={out}", "train.resume=auto"])
    wait_for(out / "checkpoints" / f"step-{(step // 4 + 1) * 4}", proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == ABORT_EXIT_CODE, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert output.count("aborted by a second SIGINT") == 1
    assert not (out / "final").exists()

    # The rest of the run from the latest complete checkpoint: the uninterrupted run's weights, bit for bit.
    done = subprocess.run(
        [*train, f"output.dir={out}", "train.resume=auto"], env=env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # And TensorBoard's points: the uninterrupted run's, each once. The stop logged its open interval before its
    # checkpoint, so the resumed run's first record covered only the steps after the stop (a point more, at the
    # stop's step, and the next one's sums short of the steps before it).
    logged, resumed = read_scalars(reference / "tensorboard"), read_scalars(out / "tensorboard")
    assert logged.keys() == resumed.keys() and [s for s, _ in logged["train/loss"]] == [*range(3, 19, 3), 20]
    for tag, points in logged.items():
        timed = "per_second" in tag or "seconds" in tag or "flops" in tag or "mfu" in tag
        assert [s for s, _ in resumed[tag]] == [s for s, _ in points] if timed else resumed[tag] == points, (
            tag
        )


def test_a_second_run_in_a_live_runs_output_dir_is_refused(run_config: Path, tmp_path: Path) -> None:
    """A relaunch while the old run's ranks still live (a launcher killed with -9 leaves them ~20 s; two jobs
    given one directory) wrote into the same checkpoints. Now it is refused in one line: by the launcher's
    preflight, and by rank 0 when the ranks are started without it (torchrun directly). The live run is
    stood in for by a process holding the lock as rank 0 does (coati_kto.runtime.run_dir.claim_output_dir)."""
    out = tmp_path / "out"
    hold = (
        "import sys, time; from pathlib import Path; from coati_kto.runtime.run_dir import claim_output_dir; "
    )
    hold += "claim_output_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)"
    live = subprocess.Popen(
        [sys.executable, "-c", hold, str(out)], env=env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert live.stdout.readline() == "held\n"
        holder = (out / ".run.lock").read_text().strip()
        assert holder.startswith(f"pid {live.pid} on ")
        expected = (
            f"error: output.dir: {out} is in use by a run still training there ({holder}): wait for it to end "
            "or stop it, or use another output.dir"
        )
        # 2 steps: the last command only has to get past the lock and train.
        train = ["train", str(run_config), f"output.dir={out}", "train.resume=auto", "train.max_steps=2"]
        second = subprocess.run(
            cli(train[0], "--nproc-per-node", "2", *train[1:]), env=env(), capture_output=True, text=True
        )
        assert (second.returncode, second.stderr.strip()) == (2, expected)
        torchrun = [
            sys.executable,
            "-m",
            "coati_kto.launch",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "coati_kto",
        ]
        second = subprocess.run([*torchrun, *train], env=env(), capture_output=True, text=True)
        assert (second.returncode, second.stderr.strip()) == (2, expected)  # rank 0's line, once
        assert sorted(p.name for p in out.iterdir()) == [".run.lock"]  # nothing written
    finally:
        live.kill()
        live.wait()
    # Killed with -9, the holder left nothing to clean up: the same command now trains (`coati-kto train`
    # without a launcher, on a worker rank: the launcher and the live second process were the cases above).
    done = run_cli(train)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()


def test_one_run_per_output_dir(run_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoints" / "step-3").mkdir(parents=True)
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    proc = run_cli(["train", str(run_config), f"output.dir={out}"])  # the CLI's refusal: on a worker rank
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: output.dir: {out} already holds a run (checkpoints/step-3, tensorboard/ events): continue it "
        "with train.resume=auto, or start over with output.overwrite=true (deletes its checkpoints, events, "
        "final model and exports)"
    )


def test_overwrite_clears_the_old_run_first(run_config: Path, tmp_path: Path) -> None:
    from coati_kto.runtime.run_dir import clear_previous_run

    out = tmp_path / "out"
    # exports/ was kept: an earlier run's exported steps beside the new run's checkpoints of the same names
    for name in ("checkpoints/step-3", "tensorboard", "final", "exports/step-3", "keep"):
        (out / name).mkdir(parents=True)
    clear_previous_run(out)  # one process: it is rank 0
    assert sorted(p.name for p in out.iterdir()) == ["keep"]


def _bad(tmp_path: Path, run_config: Path, *overrides: str) -> tuple[int, str, str]:
    # A real process: huggingface_hub reads HF_HUB_OFFLINE when it is imported, so a worker rank that imported it
    # cannot take it (run_cli would start a fresh process for it anyway: no cheaper than this one). No W&B key
    # anywhere wandb looks (the environment, a netrc file, its settings file).
    no_wandb_key = {"NETRC": str(tmp_path / "no-netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "no-wandb")}
    environ = {k: v for k, v in env().items() if k not in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")}
    proc = subprocess.run(
        cli("train", str(run_config), f"output.dir={tmp_path / 'out'}", *overrides),
        env={**environ, "HF_HUB_OFFLINE": "1", **no_wandb_key},
        capture_output=True,
        text=True,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_bad_inputs_are_reported_together_before_anything_heavy(run_config: Path, tmp_path: Path) -> None:
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    unknown = tmp_path / "unknown_type"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    (unknown / "model.safetensors").write_bytes(b"")
    locked = tmp_path / "locked"
    locked.write_text("a file where a directory should be")
    code, out, err = _bad(
        tmp_path,
        run_config,
        f"model.path={tmp_path / 'missing_model'}",
        f"model.reference_path={unknown}",
        f"model.tokenizer={not_a_model}",
        f"data.eval_files=[{tmp_path / 'missing.jsonl'}]",
        f"train.resume={tmp_path / 'no_checkpoint'}",
        f"output.dir={locked / 'out'}",
        "logging.wandb=true",
    )
    assert code == 2 and out == ""
    from transformers import __version__

    expected = [
        f"error: model.path: {tmp_path / 'missing_model'} does not exist (a local path; a hub id looks like "
        "org/name)",
        f"model.reference_path: {unknown}/config.json has model_type 'no_such_arch', which transformers "
        f"{__version__} does not know (a newer transformers, or model.trust_remote_code=true for a model that "
        "ships its code)",
        f"model.tokenizer: {not_a_model} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json)",
        f"data.eval_files: {tmp_path / 'missing.jsonl'}: no such file or directory",
        f"train.resume: checkpoint {tmp_path / 'no_checkpoint'} does not exist (train.resume=auto picks the "
        "latest one)",
        f"output.dir: {locked} is a file, not a directory",
    ]
    try:
        import wandb  # noqa: F401
    except ImportError:
        expected.append(
            "logging.wandb: true, but the wandb package is not installed: pip install wandb, or set "
            "logging.wandb=false"
        )
    else:  # online without a key: wandb.init raised on rank 0 after the model loaded (a traceback)
        expected.append(
            "logging.wandb: no W&B API key for https://api.wandb.ai (WANDB_API_KEY, `wandb login`'s ~/.netrc, "
            "or wandb's settings file): set one, or logging.wandb_mode=offline"
        )
    assert err.strip().splitlines() == expected


def test_hub_ids_offline_and_model_directories(run_config: Path, tmp_path: Path) -> None:
    code, _, err = _bad(tmp_path, run_config, "model.path=TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    assert (code, err.strip()) == (
        2,
        "error: model.path: TinyLlama/TinyLlama-1.1B-Chat-v1.0 is not a local directory and not in the hub "
        "cache, and HF_HUB_OFFLINE is set",
    )
    code, _, err = _bad(tmp_path, run_config, f"model.path={tmp_path}")
    assert (code, err.strip()) == (
        2,
        f"error: model.path: {tmp_path} holds no config.json: not a Hugging Face model directory\n"
        f"model.path (the tokenizer): {tmp_path} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json)",
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "--ranks", "-3"], "error: --ranks must be >= 1, got -3"),
        (["inspect", "--ranks", "0"], "error: --ranks must be >= 1, got 0"),
        (["train", "--nproc-per-node", "0"], "error: --nproc-per-node must be >= 1, got 0"),
    ],
)
def test_cli_numbers_in_range(run_config: Path, argv: list[str], message: str) -> None:
    proc = run_cli([*argv, str(run_config)])  # the CLI's argument checks: on a worker rank
    assert (proc.returncode, proc.stderr.strip()) == (2, message)


def _faulty_save_worker(config_path: str, overrides: list[str], fail_rank: int, fail_step: int) -> tuple:
    """Train; on ``fail_rank`` the write of step ``fail_step``'s trainer state hits a full disk."""
    from coati_kto.config.load import load_config
    from coati_kto.train import train
    from coati_kto.trainer.checkpoint import CheckpointSaveError

    real_save, rank = torch.save, int(os.environ["RANK"])

    def save(obj, f, *args, **kwargs):
        if rank == fail_rank and f"step-{fail_step}.tmp" in str(f) and "trainer_state" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    try:
        train(load_config(config_path, overrides))
    except CheckpointSaveError as err:
        return str(err), time.time()
    finally:  # this rank serves later tests (the worker pool restores torch's namespace too)
        torch.save = real_save
    return "no error", time.time()


def test_a_save_failing_on_one_rank_stops_every_rank_at_once(run_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    overrides = [f"output.dir={out}", "train.max_steps=8", "train.dist_timeout=300"]
    started = time.time()
    results = run_distributed(_faulty_save_worker, 2, str(run_config), overrides, 1, 8, timeout_s=600)
    partial = out / "checkpoints" / "step-8.tmp"
    expected = (
        f"checkpoint step-8 could not be written (rank 1: No space left on device: {partial}/trainer_state/"
        f"rank-1.pt); removed the partial step-8.tmp, the last complete checkpoint is {out}/checkpoints/step-4"
    )
    assert [message for message, _ in results] == [expected, expected]
    # Both ranks stopped together, long before train.dist_timeout (300 s) would have ended a waiting rank.
    assert abs(results[0][1] - results[1][1]) < 60 and max(t for _, t in results) - started < 280
    assert not partial.exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-4"
    assert (out / "checkpoints" / "step-4" / "COMPLETE").is_file()


def test_launch_keeps_secrets_out_of_its_output(run_config: Path, tmp_path: Path) -> None:
    from coati_kto.parallel.distributed import free_port
    from coati_kto.parallel.launch_env import launcher_env

    secret = f"planted-{os.getpid()}-{time.time_ns()}"
    names = ("WANDB_API_KEY", "HF_TOKEN", "aws_secret_access_key", "DB_PASSWORD", "MY_KEYRING")
    planted = {
        **env(),
        **dict.fromkeys(names, secret),
        "NPROC_PER_NODE": "1",
        "MASTER_PORT": str(free_port()),
    }
    repo = Path(__file__).resolve().parents[2]
    launch = ["bash", str(repo / "launch" / "colossalai_run.sh"), str(tmp_path / "missing.yaml")]
    # A user mistake (no such config) exits 2 with the ranks' one line, as with the other launchers (it was 1,
    # after colossalai run's dump of the environment it exported).
    mistake = subprocess.run(launch, env=planted, capture_output=True, text=True, timeout=300)
    said = mistake.stdout + mistake.stderr
    assert mistake.returncode == 2 and "export " not in said, said
    assert f"error: {tmp_path / 'missing.yaml'}: config file not found" in said
    assert "launcher: the command exited on 127.0.0.1; exit 2" in said
    # A launch that fails (its port taken): colossalai run prints the environment it exported.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        planted["MASTER_PORT"] = str(taken.getsockname()[1])
        proc = subprocess.run(launch, env=planted, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr + mistake.stdout + mistake.stderr
    assert proc.returncode == 1
    assert "export " in output and 'TOKENIZERS_PARALLELISM="false"' in output  # the dump this test is about
    assert secret not in output
    assert not any(secret in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())

    os.environ.update(dict.fromkeys(names, secret))
    try:
        kept = launcher_env("/opt/venv/bin")
    finally:
        for name in names:
            del os.environ[name]
    assert secret not in "".join(kept.values())
    assert set(names) <= set(kept["COATI_KTO_DROPPED_ENV"].split(","))
    assert kept["TOKENIZERS_PARALLELISM"] == os.environ["TOKENIZERS_PARALLELISM"]


def test_a_clean_stop_through_colossalai_run_exits_75(run_config: Path, tmp_path: Path) -> None:
    """colossalai run says only success/failure per node and exits 1 on failure: a SIGTERM stop (every rank
    checkpointed and exited 75) used to come out as 1, a crash to whatever restarts the job."""
    from coati_kto.parallel.distributed import free_port

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "out dir"  # colossalai run joined the arguments unquoted: a space split them
    name = "it's a [clean] stop, $HOME"  # quotes stripped, brackets split, $HOME expanded
    proc = subprocess.Popen(
        [
            "bash",
            str(repo / "launch" / "colossalai_run.sh"),
            str(run_config),
            f"output.dir={out}",
            f"logging.wandb_project={name}",
        ],
        env={**env(), "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output, stopped, step = stop_with_sigterm(proc, out)
    assert stopped.startswith("stopped by SIGTERM after step ")
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{step}"
    assert "launcher: stopped cleanly on 127.0.0.1; exit 75" in output
    assert (
        yaml.safe_load((out / "config.yaml").read_text())["logging"]["wandb_project"] == name
    )  # intact on the ranks
