"""Shared fixtures: a tiny tokenizer and Llama built offline (no hub)."""

from __future__ import annotations

import gc
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import CORPUS
from hypothesis import HealthCheck, settings

# Property tests on a loaded 2-core machine: no wall-clock deadlines or "too slow" health checks; on CI
# (CI=true) the examples are derandomized so a green run stays green while the code does not change.
settings.register_profile(
    "coati",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.load_profile("coati")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# run_distributed's calls run on one persistent set of ranks per world size (docs/testing.md, "The worker pool"),
# which import the whole package once; COATI_KTO_FRESH_PROCESSES=1 gives every call fresh processes instead.
POOL_PRELOAD = ("coati_kto.*",)

# Module fixtures' temporary folders are removed at their teardown (a run kept 0.5 GB of them to its end);
# COATI_KTO_CPU_REPORT=DIR: each test's CPU seconds, its processes' too (coati_kto.testing.cpu_report).
pytest_plugins = ["coati_kto.testing.tmp_cleanup", "coati_kto.testing.cpu_report"]


def pytest_configure(config: pytest.Config) -> None:
    from coati_kto.testing.distributed import enable_pool

    enable_pool(POOL_PRELOAD)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):
    """Collection imports torch, transformers and ColossalAI: the collector off meanwhile (full collections over
    the growing heap cost a second of each worker's CPU), then those objects frozen, so that the collections of
    the tests' run skip them (coati_kto.runtime.startup does the same for a coati-kto process)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from coati_kto.testing.distributed import pool_stats, shutdown_pool

    if hasattr(session.config, "workeroutput"):  # an xdist worker: its counts go to the controller's summary
        session.config.workeroutput["run_distributed_calls"] = pool_stats()
    shutdown_pool()


_WORKER_CALLS: Counter[str] = Counter()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The xdist controller: a worker ended; add its run_distributed counts to the summary."""
    _WORKER_CALLS.update(getattr(node, "workeroutput", {}).get("run_distributed_calls", {}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A test marked ``fresh_process`` (or in a module marked so) gets fresh processes for every
    run_distributed call of its setup, call and teardown, module-scoped fixtures it sets up included."""
    if item.get_closest_marker("fresh_process") is None:
        yield
        return
    from coati_kto.testing.distributed import fresh_processes

    with fresh_processes():
        yield


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from coati_kto.testing.distributed import pool_stats

    calls = _WORKER_CALLS + Counter(pool_stats())
    if calls:
        terminalreporter.write_line(
            "run_distributed calls: " + ", ".join(f"{n} {where}" for where, n in sorted(calls.items()))
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU kernels this run gets (coati_kto.testing.machine), so a failure can be tied to a machine."""
    from coati_kto.testing.machine import kernel_key

    key = kernel_key()
    return [
        f"kernels: {key['cpu_vendor']} {key['cpu_model']} ({key['cpu_family_model_stepping']}), "
        f"ATen {key['cpu_capability']}, ISA {' '.join(key['isa_flags']) or '-'}, "
        f"env {key['kernel_env'] or '-'}, torch {key['torch']}"
    ]


@pytest.fixture(scope="session")
def built_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where built test models live (coati_kto.testing.built): pytest's cache, kept between runs on this
    checkout; the session's temporary directory without the cache provider."""
    cache = getattr(request.config, "cache", None)
    return cache.mkdir("coati-kto-built") if cache is not None else tmp_path_factory.mktemp("built")


@pytest.fixture(scope="session")
def tiny_model_dir(built_root: Path) -> Path:
    """A saved tiny Llama + ChatML BPE tokenizer (vocab 512, hidden 64, 2 layers)."""
    from coati_kto.testing.built import built
    from coati_kto.testing.tiny import save_tiny_model

    return built(built_root, "tiny_llama", lambda out: save_tiny_model(out, CORPUS), {"corpus": CORPUS})


@pytest.fixture(scope="session")
def tiny_family_dir(built_root: Path) -> Callable[..., Path]:
    """``tiny_family_dir(family, vocab_size=300, corpus=CORPUS)``: that family's tiny model and tokenizer
    (coati_kto.testing.tiny.save_tiny_family), built once per content key and shared by every test asking."""
    from coati_kto.testing.built import built
    from coati_kto.testing.tiny import save_tiny_family

    def make(family: str, vocab_size: int = 300, corpus: Sequence[str] = CORPUS) -> Path:
        inputs = {"family": family, "vocab_size": vocab_size, "corpus": list(corpus)}
        return built(
            built_root,
            f"tiny_{family}",
            lambda out: save_tiny_family(out, family, corpus, vocab_size),
            inputs,
        )

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_dir(tiny_model_dir: Path, built_root: Path) -> Path:
    """The tiny model with perturbed weights (coati_kto.testing.tiny.save_perturbed, seed 11): a reference that
    differs from the policy, so rewards are not 0."""
    from coati_kto.testing.built import built
    from coati_kto.testing.tiny import save_perturbed

    inputs = {"model": tiny_model_dir.name, "seed": 11}
    return built(
        built_root, "tiny_llama_reference", lambda out: save_perturbed(tiny_model_dir, out, 11), inputs
    )


# The folder says what a test costs (docs/testing.md): unit/ is single-process and fast; distributed/ and
# regression/ run real gloo process groups; e2e/ the CLI (on worker ranks through run_cli, or
# launched for real where a launcher, a signal or a resume is what it proves); drills/ the
# multi-node (netns + SSH) and SLURM drills. `pytest -m "not e2e and not drill"` is the inner loop.
_FOLDER_MARKERS = {"distributed": "distributed", "regression": "distributed", "e2e": "e2e", "drills": "drill"}


# `make test-fast` (marker `smoke`): tests/unit and these, one or two per area of the costly folders, each the
# cheapest test that still runs the area's whole path (docs/testing.md). A module-scoped fixture runs whole: a
# test listed here costs its fixture's batch.
SMOKE = (
    # ColossalAI trains on 2 CPU processes (hybrid ZeRO-2 bf16) and the ranks stay in sync
    "distributed/test_foundation.py::test_hybrid_parallel_zero2_bf16_two_processes_learns_and_stays_in_sync",
    # the trainer on 2 ranks under tensor parallelism: learns, ranks agree
    "distributed/test_trainer.py::test_tensor_parallel_two_ranks_learns_and_agrees",
    # save and resume bit for bit
    "distributed/test_checkpoint.py::test_fp32_resume_is_bit_identical",
    # one family's lifecycle on each plugin: train, step-1 parity, resume, export
    "distributed/test_families.py::test_lifecycle[llama-ddp fp32]",
    # LoRA: train, resume, export merged
    "distributed/test_lora.py::test_lora_lifecycle[ddp]",
    # bf16 step-0 parity of policy and reference
    "distributed/test_precision.py::test_bf16_policy_matches_reference_at_long_positions[low_level_zero]",
    # a fixed-seed run reproduces its recorded metrics and weights
    "regression/test_reference_runs.py::test_run_matches_reference[ddp_fp32]",
    # the CLI trains, logs and resumes (train, then `coati-kto train ... resume=auto`)
    "e2e/test_train_e2e.py::test_zero2_bf16_two_processes_learns_preferences",
    # a real launcher: launch/torchrun.sh starts 2 processes that train
    "e2e/test_launch.py::test_torchrun_script_reads_a_config_relative_to_where_it_is_run",
)


# `make test` runs two pytest-xdist workers, each given a whole file at a time (--dist loadfile, in collection
# order). These files take longest (seconds of one worker, below), so they are handed
# out first: the short files then fill the gaps and neither worker ends alone on a long one. Only the order
# changes; a file missing here runs after them, in pytest's order.
LONGEST_FIRST = (  # seconds of one worker in `make test` (2026-11-29, 748 s of pytest on the AMD EPYC)
    "e2e/test_benchmarks.py",  # 239: its smokes run ahead, two at a time, beside its tests
    "drills/test_drills.py",  # 173
    "e2e/test_operations.py",  # 118
    "distributed/test_families.py",  # 102
    "e2e/test_hub.py",  # 95
    "distributed/test_layouts_4_families.py",  # 50
    "distributed/test_mixed_adamw.py",  # 47
    "e2e/test_launch.py",  # 46
    "e2e/test_layouts_4_resume.py",  # 37
    "e2e/test_stopped_commands.py",  # 37 (2026-12-01)
    "distributed/test_runner_pool.py",  # 35
    "e2e/test_install_profiles.py",  # 35
    "e2e/test_image_feedback.py",  # 29
    "distributed/test_bad_input_train.py",  # 26
    "distributed/test_image_train.py",  # 24
    "e2e/test_readme_example.py",  # 23
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    tests_dir = Path(__file__).resolve().parent
    no_cuda = pytest.mark.skip(reason="needs CUDA (a `gpu` test: make gpu-check runs them on a GPU)")
    smoke = set(SMOKE)
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        path = Path(str(item.fspath)).resolve().relative_to(tests_dir)
        marker = _FOLDER_MARKERS.get(path.parts[0])
        if marker is not None:
            item.add_marker(marker)
        if f"{path.as_posix()}::{item.name}" in smoke:
            item.add_marker(pytest.mark.smoke)
            smoke.discard(f"{path.as_posix()}::{item.name}")
    _check_smoke_found(smoke, items, tests_dir, config.args)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects, and must collect the same order
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        # A stable sort: each file's tests stay together and in their order.
        items.sort(key=lambda item: rank.get(_relative(item, tests_dir), len(rank)))


def _relative(item: pytest.Item, tests_dir: Path) -> str:
    return Path(str(item.fspath)).resolve().relative_to(tests_dir).as_posix()


def _check_smoke_found(missing: set[str], items: list[pytest.Item], tests_dir: Path, args: list[str]) -> None:
    """A SMOKE entry whose file was collected whole but which matched no test (renamed, reparametrized) is an
    error, not a smoke set that silently shrinks. A file named with ``::`` on the command line is not whole."""
    narrowed = {Path(a.partition("::")[0]).resolve() for a in args if "::" in a}
    collected = {
        _relative(item, tests_dir) for item in items if Path(str(item.fspath)).resolve() not in narrowed
    }
    lost = sorted(name for name in missing if name.partition("::")[0] in collected)
    if lost:
        raise pytest.UsageError(f"tests/conftest.py SMOKE names tests that do not exist: {', '.join(lost)}")
