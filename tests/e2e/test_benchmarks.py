"""Every script in benchmarks/ runs its smoke mode and prints finite figures, so none can rot.

Figures, not exit codes: each test parses what the script prints (its table) and checks the numbers are there
and finite (step time > 0, tokens/s > 0, ...). A script runs in a subprocess, as a user runs it: the module's
first test starts the selected tests' subprocesses, two at a time (:class:`Ahead`), and each test waits for its
own. A script whose figures are not of its own process (ddp_unused_bench, optimizer_bench, padding_bench, plan_table,
plan_validation, prepare_bench) runs its ``main`` here instead (:func:`smoke_here`): no interpreter and imports of its own, its
ranks on the worker pool. The ones that start several training processes (lora_bench, plugins_bench,
step_bench: 10-15 CPU-s each on 2 cores; learning_study, gpu_check) are marked ``slow`` (``-m "not slow"`` leaves them
out); trl_side_by_side skips unless a TRL venv exists (TRL is never a dependency).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"


Command = tuple[tuple[str, ...], dict[str, str], float]  # argv, environment, timeout in seconds


def smoke_command(script: str, *args: str, timeout: float = 300) -> Command:
    """``benchmarks/<script> --smoke ARGS``, run from the repository root."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }
    return (sys.executable, str(BENCH / script), "--smoke", *args), env, timeout


def gpu_check_command(work: Path) -> Command:
    """`make gpu-check`'s script with this Python (its own choice of Python is the GPU machine's)."""
    env = {
        **os.environ,
        "GPU_CHECK_PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    return ("bash", str(BENCH / "gpu_check.sh"), "--out", str(work)), env, 900


def _execute(command: Command, live: set[subprocess.Popen] | None = None) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``command`` (its process group killed at its timeout)."""
    argv, env, timeout = command
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    ) as proc:
        if live is not None:
            live.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            err += f"\ntimed out after {timeout:.0f} s"
        finally:
            if live is not None:
                live.discard(proc)
    return proc.returncode, out, err


class Ahead:
    """The subprocess smokes of the tests this session selected, started before their tests, ``AT_ONCE`` at a
    time: a smoke's processes run one thread each and spend much of their time importing, so on 2 cores two
    smokes take little more wall time than one. Each test still checks its own smoke's output; the time it waits
    is what is left of its run (pytest's durations show the waits, not each smoke's length)."""

    AT_ONCE = 2

    def __init__(self, commands: list[Command]) -> None:
        self._live: set[subprocess.Popen] = set()
        self._closed = False
        self._pool = ThreadPoolExecutor(self.AT_ONCE, thread_name_prefix="smoke")
        self.runs = {c[0]: self._pool.submit(self._run, c) for c in commands}

    def _run(self, command: Command) -> tuple[int, str, str]:
        if self._closed:
            return -1, "", "not run: the module's tests ended first"
        return _execute(command, self._live)

    def close(self) -> None:
        """Kill what still runs (an interrupted session, a test that failed before reading its smoke)."""
        self._closed = True
        for run in self.runs.values():
            run.cancel()
        for proc in list(self._live):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._pool.shutdown(wait=True)


_AHEAD: Ahead | None = None


def run_smoke(command: Command) -> str:
    """``command``'s stdout (asserting exit 0): the run started ahead when there is one, else a run now."""
    run = _AHEAD.runs.get(command[0]) if _AHEAD is not None else None
    code, out, err = run.result() if run is not None else _execute(command)
    assert code == 0, f"{' '.join(command[0])} exited {code}:\n{out[-3000:]}\n{err[-3000:]}"
    return out


def smoke(script: str, *args: str, timeout: float = 300) -> str:
    """Run ``benchmarks/<script> --smoke ARGS`` from the repository root; its stdout (asserting exit 0)."""
    return run_smoke(smoke_command(script, *args, timeout=timeout))


# gpu_bench's cases the smoke runs: every value of each axis (model, row shape, reference, plugin, padding-free,
# compiled) and every pair the test compares, not the whole product (21 cases, 12 of them pairs seen already: about
# 30 CPU-s more). Each name is a whole case name, so it selects that case alone.
GPU_BENCH_CASES = (
    "llama/tool_use/online/hybrid_z2",
    "llama/tool_use/online/hybrid_z2/compile",  # compared with the eager case above
    "llama/half/cached/hybrid_z2",
    "llama/tool_use/cached/hybrid_z2/free",
    "llama/half/online/hybrid_z2/free",
    "llama/half/online/lowlevel_z2",
    "llama/tool_use/cached/lowlevel_z2",
    "qwen3/tool_use/online/hybrid_z2",
    "qwen3/tool_use/online/lowlevel_z2",
    "qwen3/half/cached/lowlevel_z2",
)

# The command each subprocess smoke test runs, by test id, given its own work directory. Ahead starts them in this
# order: the longest first, then the short ones (their tests come next), then the long ones, longest first.
SMOKES: dict[str, Callable[[Path], Command]] = {
    # GPU_BENCH_CASES (about 70 CPU-s cold, most of it the compiled case's inductor build): beside the suite's two
    # workers and another smoke on 2 cores the whole list once ran past 300 s, so it gets the study's bound.
    "test_gpu_bench_smoke": lambda w: smoke_command(
        "gpu_bench.py",
        *("--out", str(w), "--trl-venv", str(w / "no-trl-venv"), "--cases", ",".join(GPU_BENCH_CASES)),
        timeout=900,
    ),
    "test_logprobs_bench_smoke": lambda w: smoke_command("logprobs_bench.py"),
    "test_logprobs_bench_head_smoke": lambda w: smoke_command("logprobs_bench.py", "--head"),
    "test_logprobs_bench_head_chunks_smoke[kept]": lambda w: smoke_command(
        "logprobs_bench.py", "--head-chunks"
    ),
    "test_logprobs_bench_head_chunks_smoke[glibc-default]": lambda w: smoke_command(
        "logprobs_bench.py", "--head-chunks", "--glibc-default"
    ),
    "test_sampler_report_smoke": lambda w: smoke_command("sampler_report.py"),
    "test_step_bench_smoke": lambda w: smoke_command("step_bench.py", "--work", str(w / "work")),
    "test_gpu_check_smoke": gpu_check_command,
    "test_lora_bench_smoke": lambda w: smoke_command("lora_bench.py"),
    "test_plugins_bench_smoke": lambda w: smoke_command("plugins_bench.py"),
    "test_learning_study_smoke": lambda w: smoke_command(
        "learning_study.py", "--work", str(w), "--venv", str(ROOT / ".trl-venv"), timeout=900
    ),
}


@pytest.fixture(scope="module", autouse=True)
def ahead(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Starts the selected tests' smokes (Ahead); the directory their work directories are in."""
    global _AHEAD
    base = tmp_path_factory.mktemp("smokes")
    names = [i.name for i in request.session.items if getattr(i, "module", None) is request.module]
    _AHEAD = Ahead([command(base / n) for n, command in SMOKES.items() if n in names])
    try:
        yield base
    finally:
        _AHEAD.close()
        _AHEAD = None


@pytest.fixture
def smoke_out(request: pytest.FixtureRequest, ahead: Path) -> str:
    """This test's smoke's stdout (SMOKES), asserting exit 0."""
    return run_smoke(SMOKES[request.node.name](ahead / request.node.name))


def smoke_here(capsys: pytest.CaptureFixture[str], script: str, *args: str) -> str:
    """``main(["--smoke", *args])`` of ``benchmarks/<script>`` in this process; its stdout (asserting it returned 0
    or None). Only for a script whose figures are not of its own process (no RSS high-water mark, no process start,
    no process-wide malloc setting): its imports are this process's, its run_distributed calls run on the worker
    pool (docs/testing.md)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    module = importlib.import_module(script.removesuffix(".py"))
    capsys.readouterr()
    status = module.main(["--smoke", *args])
    assert status in (0, None), f"{script} returned {status}"
    return capsys.readouterr().out


def numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(NUMBER, line)]


def positive_finite(values: list[float], what: str) -> None:
    assert values, f"no figures for {what}"
    for v in values:
        assert math.isfinite(v) and v > 0, f"{what}: {v}"


# Modules the scripts import, not scripts: tested through them (counts.py: gpu_bench's and step_bench's counts;
# busy.py: gpu_bench's GPU busy time per category, which only a GPU profile feeds: its own test below).
HELPERS = {"counts.py", "busy.py", "flops.py"}


def test_every_benchmark_has_a_test() -> None:
    """A new script in benchmarks/ needs its smoke test here."""
    scripts = {p.name for p in BENCH.glob("*.py")} - HELPERS
    tested = {n for n in re.findall(r'"(\w+\.py)"', Path(__file__).read_text()) if (BENCH / n).exists()}
    assert scripts <= tested, f"benchmarks without a smoke test: {sorted(scripts - tested)}"


def test_gpu_busy_time_by_category() -> None:
    """benchmarks/busy.py on profiler events shaped as torch's (a CPU op, its parents, the kernels linked to it):
    each kernel (names as CUDA traces show them) in the kernel counter's category, through its launching op."""
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCH))
    from busy import busy_by_category, kernel_category

    def op(name: str, parent: object | None, start: float = 5.0, kernels: tuple = ()) -> SimpleNamespace:
        kinds = [SimpleNamespace(name=k, duration=us) for k, us in kernels]
        return SimpleNamespace(
            name=name, cpu_parent=parent, time_range=SimpleNamespace(start=start), kernels=kinds
        )

    step = op("Optimizer.step#AdamW.step", None)
    linear = op("aten::matmul", op("aten::linear", None))
    sdpa = op("aten::_scaled_dot_product_efficient_attention", op("aten::scaled_dot_product_attention", None))
    events = [
        op("aten::mm", linear, kernels=(("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 3000),)),
        op("aten::_efficient_attention_forward", sdpa, kernels=(("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", 800),)),
        op("CompiledFunction", None, kernels=(("triton_tem_fused_0", 700), ("Memcpy HtoD (Pageable -> Device)", 9))),
        op("aten::_fused_adam_", step, kernels=(("multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>", 500),)),
        op("aten::_foreach_norm", step, kernels=(("multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor>", 90),)),
        op("c10d::allreduce_", None, kernels=(("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 60),)),
        op("aten::copy_", op("aten::_to_copy", None), kernels=(("elementwise_kernel<direct_copy_kernel_cuda>", 40),)),
        op("aten::_log_softmax", op("aten::log_softmax", None), kernels=(("cunn_SoftMaxForward<LogSoftMaxEpilogue>", 30),)),
        op("aten::mul", None, kernels=(("vectorized_elementwise_kernel<4, MulFunctor<float>>", 20),)),
        op("aten::mm", None, start=50.0, kernels=(("sm90_xmma_gemm", 1e6),)),  # after the window: not this step
    ]  # fmt: skip
    busy = busy_by_category(events, 0.0, 10.0, 2, busy_ms=2.7)  # 2 steps, 2.7 ms of kernel time per step
    expected = {
        "model matmuls": 1.5, "attention": 0.75, "optimizer": 0.25, "gradient norm": 0.045,
        "gradient buckets and reductions": 0.03, "casts and copies": 0.02, "LM head and log-softmax": 0.015,
        "norms / rotary / activations": 0.01, "other": 2.7 - 2.62,
    }  # fmt: skip
    assert busy.keys() == expected.keys() and all(abs(busy[k] - v) < 1e-9 for k, v in expected.items()), busy
    assert kernel_category("void gemv2T_kernel", []) == "other"  # no launching op: not attributed


def _axis_values(names: Iterable[str]) -> list[set[str]]:
    """Each axis's values over gpu_bench case names (model/shape/reference/plugin[/free|/compile])."""
    return [{(name.split("/") + [""])[i] for name in names} for i in range(5)]


def test_gpu_bench_smoke(smoke_out: str) -> None:
    """GPU_BENCH_CASES on CPU: each run row has step time, tokens/s, TFLOP/s and host ops per step; the GPU
    columns say n/a. A case the config check refuses (none today) is skipped with its reason."""
    out = smoke_out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case ") and "host_ops" in line)
    titles = lines[header].split()
    rows = {}
    for line in lines[header + 1 :]:
        if not line or line.startswith("per optimizer step"):
            break
        rows[line.split()[0]] = line
    expected = set(GPU_BENCH_CASES)
    assert set(rows) - {"TRL"} == expected, sorted(set(rows) ^ expected)
    # every value of every axis of gpu_bench's cases is in the list (a case with a new value must join it)
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    every = [case.name for case in importlib.import_module("gpu_bench").all_cases()]
    assert _axis_values(GPU_BENCH_CASES) == _axis_values(every), (GPU_BENCH_CASES, every)
    ran = skipped = 0
    for name in expected:
        cells = rows[name].split()
        if "skipped:" in rows[name]:
            assert "plugin" in rows[name], rows[name]  # the reason, from the config check
            skipped += 1
            continue
        assert "FAILED" not in rows[name], rows[name]
        figures = dict(zip(titles[1:], cells[1:], strict=True))
        positive_finite([float(figures[k]) for k in ("step_s", "tok/s", "TFLOP/s", "host_ops")], name)
        # One process: hybrid_parallel runs without ZeRO (nothing to shard), low_level_zero is ZeRO by name.
        assert figures["ZeRO"] == ("0" if "/hybrid_z2" in name else "2"), rows[name]
        assert {figures[k] for k in ("MFU", "peakGiB", "GPUbusy", "kernels", "syncs", "DtoH")} == {"n/a"}
        # the kernel counter's prediction (benchmarks/counts.py): kernels per step, one host sync per step
        predicted_kernels = float(cells[titles.index("kernels") + 1])
        predicted_syncs = float(cells[titles.index("syncs") + 1])
        assert predicted_kernels > 0 and predicted_syncs == 1.0, rows[name]
        ran += 1
    assert ran >= len(expected) - 1, (ran, skipped)  # at most one refused by the config check
    # model.compile's case: each compiled region's kernels count once, so it predicts fewer kernels than eager
    eager, compiled = (
        rows["llama/tool_use/online/hybrid_z2"].split(),
        rows["llama/tool_use/online/hybrid_z2/compile"].split(),
    )
    k = titles.index("kernels") + 1
    assert "FAILED" not in compiled and 0 < float(compiled[k]) < float(eager[k]), (compiled, eager)
    # the per-category table: every category listed per case, with bytes per parameter
    assert out.count("gradient norm   ") >= ran and out.count("host syncs (as CUDA counts)") >= ran, out
    assert "TRL" in rows and "skipped:" in rows["TRL"], rows.get("TRL")


def test_logprobs_bench_smoke(smoke_out: str) -> None:
    out = smoke_out
    rows = [line for line in out.splitlines() if line.startswith("realistic ")]
    assert len(rows) == 2, out
    for row in rows:
        *_, tokens, median, fastest, extra_mib = numbers(row)
        positive_finite([tokens, median, fastest], row)
        assert math.isfinite(extra_mib), row


def test_logprobs_bench_head_smoke(smoke_out: str) -> None:
    out = smoke_out
    for variant in ("logits", "chunked"):
        line = next(line for line in out.splitlines() if line.startswith(variant + " "))
        positive_finite(numbers(line), line)
    ratio = next(line for line in out.splitlines() if line.startswith("chunked / logits"))
    assert all(math.isfinite(v) for v in numbers(ratio)), ratio


@pytest.mark.parametrize("malloc", ["kept", "glibc-default"])
def test_logprobs_bench_head_chunks_smoke(malloc: str, smoke_out: str) -> None:
    """Each block size's head times, with freed memory kept as train keeps it (coati_kto.runtime.host_memory) or
    under glibc's default settings (--glibc-default, what had set the old 2 MiB blocks)."""
    out = smoke_out  # --head-chunks, with --glibc-default for glibc-default
    rows = [line for line in out.splitlines() if line.split()[1:2] == ["MiB"]]
    assert [row.split()[0] for row in rows] == ["1", "2", "4", "8", "16", "32"], out
    header = out.splitlines()[0]
    if malloc == "kept":  # keep_freed_memory sets glibc's malloc; another C library is left as it is
        assert header.endswith(("freed memory kept", "not glibc")), out
    else:
        assert header.endswith("glibc default malloc settings"), out
    for row in rows:
        positive_finite(numbers(row), row)  # block MiB, columns, forward ms, fwd+bwd ms


@pytest.mark.compile
def test_optimizer_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The bf16 optimizer step: today's casts around torch's fused AdamW (4 kernels, 40 bytes per parameter)
    against train.fused_optimizer's one compiled pass (28 bytes; one C++ kernel for the 21 tensors)."""
    import torch

    try:
        out = smoke_here(capsys, "optimizer_bench.py")
    finally:
        torch._dynamo.reset()  # MixedAdamW's compiled step: later tests in this process start from none
    rows = {
        line.split()[0]: numbers(line) for line in out.splitlines() if line.startswith(("cast+", "mixed"))
    }
    assert set(rows) == {"cast+fused", "mixed"}, out
    for first_s, step_ms, kernels, per_param in rows.values():
        # the uncompiled path's first call can round to 0 on a fast or idle machine (it read 0.00 in CI)
        assert math.isfinite(first_s) and first_s >= 0, out
        positive_finite([step_ms, kernels, per_param], out)
    assert rows["cast+fused"][2:] == [4, 40.0] and rows["mixed"][2:] == [1, 28.0], rows


def test_prepare_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    out = smoke_here(capsys, "prepare_bench.py")
    m = re.search(r"cold (\S+) s = (\S+) examples/s \((\S+) tokens/s", out)
    assert m, out
    positive_finite([float(g.replace(",", "")) for g in m.groups()], "prepare cold build")


def test_ragged_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    out = smoke_here(capsys, "ragged_bench.py")
    m = re.search(r"rows 20,000  tokens 1,280,000 \(.*\)  chunks 1\njoin (\S+) s = (\S+) tokens/s", out)
    assert m and "checked rows [0, 10000, 19999]: each its own prompt + completion" in out, out
    positive_finite([float(g.replace(",", "")) for g in m.groups()], "ragged join")
    m = re.search(r"\ndataset (\S+) s  peak RSS growth (\S+) GiB\n", out)
    assert m and float(m[1]) >= 0 and 0 <= float(m[2]) < 1, out


def test_sampler_report_smoke(smoke_out: str) -> None:
    out = smoke_out
    rows = [line for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s+\d+\s+[\d.]+%$", line)]
    assert len(rows) == 6, out
    for row in rows:
        positive_finite(numbers(row.rstrip("%")), row)


@pytest.mark.slow
def test_lora_bench_smoke(smoke_out: str) -> None:
    out = smoke_out
    for mode in ("full", "lora"):
        line = next(line for line in out.splitlines() if line.strip().startswith(mode + ":"))
        positive_finite(numbers(line), line)
    assert re.search(rf"lora saves ({NUMBER}) MiB", out), out


@pytest.mark.slow
def test_plugins_bench_smoke(smoke_out: str) -> None:
    out = smoke_out
    line = next(line for line in out.splitlines() if line.startswith("| hybrid zero2 bf16"))
    assert "failed" not in line, line
    cells = [c.strip() for c in line.strip("|").split("|")[1:]]
    step0, slowest, rss, loss = float(cells[0]), float(cells[1]), cells[2], float(cells[3])
    positive_finite([step0, slowest, loss, *[float(x) for x in rss.split("/")]], line)


def test_plan_validation_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Predicted and measured peak per rank of each layout (figures only: the smoke's 2-layer model is too small
    for the 15% the 98M run holds, docs/performance.md). Its ranks on the worker pool: the figures are tracked
    tensor bytes, nothing of the process's own. One layout: the script's path is the same for each (the 98M run
    covers all of them)."""
    out = smoke_here(capsys, "plan_validation.py", "--work", str(tmp_path), "--layouts", "zero2")
    rows = [line for line in out.splitlines() if re.match(r"\| (ddp|zero2|tp2) \|", line)]
    assert sorted(row.split("|")[1].strip() for row in rows) == ["zero2", "zero2"]  # both ranks
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        positive_finite([float(cells[3]), float(cells[4])], row)  # predicted, measured MiB


def test_plan_table_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """The 8B rows of docs/plan.md's two tables: each a layout that fits at a micro-batch of at least 2. Here: the
    figures are the plan's arithmetic, nothing of the process's own."""
    out = smoke_here(capsys, "plan_table.py")
    rows = [line for line in out.splitlines() if line.startswith("| 8B |")]
    assert len(rows) == 8, out  # the admitted sizes, then every pipeline size
    for row in rows:
        batches = [int(b) for b in re.findall(r"micro-batch (\d+) \(", row)]
        assert len(batches) == 3 and min(batches) >= 2, row


def test_ddp_unused_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Its two ranks on the worker pool (step times only: nothing of the processes' own)."""
    out = smoke_here(capsys, "ddp_unused_bench.py")
    for mode in ("on", "off"):
        line = next(line for line in out.splitlines() if line.startswith(f"| {mode} |"))
        positive_finite(numbers(line), line)
    assert any(line.startswith("| on - off |") for line in out.splitlines()), out


@pytest.mark.slow
def test_step_bench_smoke(smoke_out: str) -> None:
    out = smoke_out
    lines = out.splitlines()
    for run in ("online", "cached"):
        line = next(line for line in lines if line.split()[:1] == [run])
        positive_finite(numbers(line), line)  # step CPU/wall s, tokens/s, GFLOP/s, process s, RSS
    assert re.search(rf"step time cached / online.*: CPU ({NUMBER}), wall ({NUMBER})", out), out


def test_trl_side_by_side_smoke(tmp_path: Path) -> None:
    venv = ROOT / ".trl-venv"
    if not (venv / "coati-bench-spec.txt").exists():
        pytest.skip(f"no TRL venv at {venv}: TRL is never a dependency (trl_side_by_side.py builds one)")
    out = smoke(
        "trl_side_by_side.py",
        "--venv",
        str(venv),
        "--work",
        str(tmp_path / "work"),
        "--pairs",
        "2",
        timeout=900,
    )
    for mode in ("online", "cached"):  # two pairs per mode, each a positive ratio, and their median
        pair_line = re.search(
            rf"^  {mode}\s+({NUMBER})x, ({NUMBER})x; median ({NUMBER})x$", out, re.MULTILINE
        )
        assert pair_line, out
        first, second, median = (float(v) for v in pair_line.groups())
        assert min(first, second) > 0 and median == pytest.approx((first + second) / 2, abs=0.006), out
    table_row = re.compile(r"^(TRL|coati-kto)\s+(online|precompute_ref_log_probs|cached)\b")
    rows = [line for line in out.splitlines() if table_row.match(line) and "floor:" not in line]
    assert len(rows) == 8, out  # the step table, then the floor table
    for row in rows:
        positive_finite(
            numbers(row), row
        )  # step wall/CPU s, RSS, ...; GFLOP, attention, floor s, step / floor
    for row in rows[4:]:
        assert numbers(row)[-1] > 1.0, row  # no step beats the floor of its own matmuls
    assert len(re.findall(rf"step / coati-kto \w+ floor: ({NUMBER})x", out)) == 2, out


def test_flop_counter_counts_gemms_and_cpu_attention() -> None:
    """benchmarks/flops.py: a linear layer's forward and backward are 3 x 2mkn; CPU sdpa (which torch's own
    counter leaves out) forward 2 x 2 b h s^2 d, backward 2.5x that; the GEMM rate is a rate."""
    import torch

    sys.path.insert(0, str(BENCH))
    try:
        import flops
    finally:
        sys.path.remove(str(BENCH))
    m, k, n = 48, 32, 24
    x, w = torch.randn(m, k, requires_grad=True), torch.randn(n, k, requires_grad=True)
    with flops.counter() as mode:
        torch.nn.functional.linear(x, w).sum().backward()
    assert flops.counted(mode) == {"matmul": 3 * 2 * m * k * n, "attention": 0.0, "total": 3 * 2 * m * k * n}
    b, h, s, d = 2, 3, 16, 8
    q, kk, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with flops.counter() as mode:
        torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True).sum().backward()
    forward = 2 * 2 * b * h * s * s * d
    assert flops.counted(mode) == {"matmul": 0.0, "attention": 3.5 * forward, "total": 3.5 * forward}
    assert 1e8 < flops.gemm_rate(64, [(32, 32)], repeats=2) < 1e14


@pytest.mark.slow
def test_learning_study_smoke(smoke_out: str) -> None:
    """One seed of one task: the SFT base, coati-kto (and TRL when its venv exists), the held-out gains."""
    venv = ROOT / ".trl-venv"
    out = smoke_out
    rows = {line.split()[2]: line for line in out.splitlines() if line.split()[:2] == ["after/chatml", "0"]}
    expected = {"coati-kto", "TRL"} if (venv / "coati-bench-spec.txt").exists() else {"coati-kto"}
    assert set(rows) == expected, out
    for row in rows.values():
        gain, accuracy, kl, kl_tail = numbers(row.split(maxsplit=3)[3].replace("%", ""))
        assert all(math.isfinite(v) for v in (gain, kl, kl_tail)), row
        assert 0.0 <= accuracy <= 100.0 and kl >= 0.0 and kl_tail >= 0.0, row
    summary = next(
        line for line in out.splitlines() if line.split()[:3] == ["after/chatml", "mean", "coati-kto"]
    )
    assert re.search(rf"train/kl ({NUMBER})", summary), summary


def test_padding_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    out = smoke_here(capsys, "padding_bench.py")
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split()[:1] in (["tool_use"], ["half"], ["long_tail"])
    }
    assert set(rows) == {"tool_use", "half", "long_tail"}, out
    for line in rows.values():
        fractions = [float(v.rstrip("%")) for v in line.split()[2:]]
        assert len(fractions) == 11, line
        for padded, padded64, bins, free in (fractions[0:4], fractions[4:8]):
            assert 0.0 < padded <= padded64 < 100.0, line  # real padding
            assert bins <= padded and free == 0.0, line  # bins never pad more; one row not at all
        assert fractions[9] <= fractions[8] and fractions[10] == 0.0, line


# Its per-layer check (sp 2, fp32, checkpointing) read 1.0261 and 1.5 of 1.0000 in whole-suite runs on pooled ranks
# and 1.5 on fresh ranks: a collective's input released late on gloo's thread; each depth is now measured three
# times and the least taken (sp_memory_bench._per_layer).
def test_sp_memory_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """Its ranks (sp 1 and 2) on the worker pool: the figures are tracked tensor bytes, nothing of the process's
    own. Per rank, sp 2 keeps less than sp 1 and more than half of it (the whole-row mask, and one more q-wide
    tensor per layer); the per-layer formula equals the tracker's per-layer bytes in fp32; the longest row within
    the budget fits it, the next step does not, and it grows with sp."""
    out = smoke_here(capsys, "sp_memory_bench.py")
    lines = out.splitlines()
    rows = [line for line in lines if re.match(r"\| (256|512) \| (yes|no) \|", line)]
    assert len(rows) == 4, out
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        ratio, bare = float(cells[4]), float(cells[5])
        assert 0.5 < bare < ratio < 0.7, line
    checks = {tuple(line.split("|")[1:4]): line for line in lines if re.match(r"\| [12] \| fp32 \|", line)}
    assert len(checks) == 4, out
    for line in checks.values():
        assert line.rstrip().endswith("| 1.0000 |"), line  # measured / formula
    longest = {}
    for line in lines:
        match = re.match(r"\| ([12]) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|$", line)
        if match:
            longest[int(match[1])] = (int(match[2]), float(match[3]), float(match[4]))
    assert set(longest) == {1, 2}, out
    for tokens, fits, over in longest.values():
        assert tokens > 0 and fits <= 3.0 < over  # the smoke's budget: 3 MiB
    assert longest[2][0] > longest[1][0]


@pytest.mark.slow
def test_gpu_check_smoke(smoke_out: str) -> None:
    """`make gpu-check`'s plumbing without CUDA (benchmarks/gpu_check.sh -> "gpu_check.py"): every `gpu` test is
    listed as skipped, then the short bench's case with a finite step time; one table. One case (gpu_check's
    SMOKE_BENCH_CASES): its whole name still selects it alone, and test_gpu_bench_smoke checks the cached one."""
    lines = smoke_out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpu-check on CPU"))
    bench = next(i for i, line in enumerate(lines) if line.startswith("bench case"))
    tests = {line.split()[0]: line.split()[1] for line in lines[start + 2 : bench]}
    lifecycle = {f"test_family_lifecycle_on_cuda[{f}]" for f in ("llama", "qwen3", "gemma3")}
    rotary = "test_fused_rotary_in_bf16_is_as_near_the_exact_values_as_transformers[cuda]"
    assert lifecycle | {"test_gradient_norm_is_the_same_on_every_plugin[cuda]", rotary} <= set(tests), tests
    assert set(tests.values()) == {"skipped"}, tests  # no CUDA: the gpu tests skip, none fails
    cases = {line.split()[0]: line.split()[1:] for line in lines[bench + 1 :] if line.startswith("llama/")}
    # its case by its whole name (gpu_bench --cases): not the compiled and padding-free ones it prefixes
    assert set(cases) == {"llama/tool_use/online/hybrid_z2"}, cases
    step_s, mfu, syncs, kernels = cases["llama/tool_use/online/hybrid_z2"]
    positive_finite([float(step_s)], "llama/tool_use/online/hybrid_z2")
    assert (mfu, syncs, kernels) == ("n/a", "n/a", "n/a"), cases  # no GPU figures on the CPU
