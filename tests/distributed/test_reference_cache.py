"""kto.reference: cached on 2 gloo processes: the cache equals online scoring, a cached run's loss curve equals
the online run's, and a cache for other reference weights (same path) or a damaged one is recomputed, said once.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from coati_kto.data.files import write_jsonl
from coati_kto.testing.distributed import run_distributed

PROMPTS = ["What is the capital of France?", "Please add 2 and 3.", "What is the weather in Berlin?"]
ANSWERS = ["The capital of France is Paris.", "The answer is 5. Thank you!", "I cannot help with that."]


def _records(n: int, offset: int) -> list[dict]:
    return [
        {
            "prompt": f"{PROMPTS[i % 3]} ({i + offset})",
            "completion": ANSWERS[(i + offset) % 3] * (1 + i % 2),
            "label": i % 4 != 3,
        }
        for i in range(n)
    ]


def _perturb(model_dir: Path, out: Path, seed: int) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def _config(root: Path, model_dir: Path, reference_dir: Path, reference: str):
    from coati_kto.config.schema import Config

    return Config.model_validate(
        {
            "model": {
                "path": str(model_dir),
                "tokenizer": str(model_dir),
                "reference_path": str(reference_dir),
            },
            "data": {
                "train_files": [str(root / "train.jsonl")],
                "eval_files": [str(root / "eval.jsonl")],
                "prepared_dir": str(root / "prepared"),
                "max_length": 64,
                "max_prompt_length": 32,
            },
            "kto": {"beta": 0.5, "reference": reference, "precompute_batch_size": 3},
            "train": {"micro_batch_size": 4, "max_steps": 4, "lr": 1e-2, "eval_interval": 2, "seed": 1},
            "plugin": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
            "output": {"dir": str(root / f"out-{reference}"), "save_final": False},
            "logging": {"tensorboard": False},
        }
    )


def _ensure(config, data) -> tuple[dict, str]:
    from coati_kto.recipe.setup import reference_settings
    from coati_kto.reference.cache import ensure_reference_cache

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        values = ensure_reference_cache(reference_settings(config), data, 0)
    return values, out.getvalue().strip()


def _worker(root: str, model_dir: str, reference_dir: str) -> dict:
    import torch.distributed as dist
    from helpers import data_settings

    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.prepared import load_prepared
    from coati_kto.models.hf import load_reference
    from coati_kto.models.lm_head import LMHead, model_sequence_logps
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.train import train

    root_p, rank = Path(root), dist.get_rank()
    online = train(_config(root_p, Path(model_dir), Path(reference_dir), "online"))
    cached = train(_config(root_p, Path(model_dir), Path(reference_dir), "cached"))
    config = _config(root_p, Path(model_dir), Path(reference_dir), "cached")
    data = load_prepared(*data_settings(config))
    values, reuse_line = _ensure(config, data)

    # Online scoring, one row at a time in separate passes: what the cache must equal.
    expected = {}
    if rank == 0:
        model = load_reference(config.model, ParallelPlan.from_config(config).dtype)
        head = LMHead.find(model)
        collate = KTOCollator(0)
        for split, ds in (("train", data.train), ("eval", data.eval)):
            rows = []
            with torch.no_grad():
                for i in range(len(ds)):
                    b = collate([ds[i]])
                    rows.append(
                        [
                            float(
                                model_sequence_logps(
                                    model,
                                    b.example.input_ids,
                                    b.example.attention_mask,
                                    b.example.loss_mask,
                                    head,
                                )
                            ),
                            float(
                                model_sequence_logps(
                                    model, b.kl.input_ids, b.kl.attention_mask, b.kl.loss_mask, head
                                )
                            ),
                        ]
                    )
            expected[split] = np.array(rows)
    dist.barrier()

    # The same reference path with other weights: recomputed, said in one line. Then a damaged file.
    if rank == 0:
        _perturb(Path(model_dir), Path(reference_dir), seed=99)
    dist.barrier()
    changed, changed_line = _ensure(config, data)
    cache_dirs = sorted(p.name for p in (root_p / "prepared" / "reference_cache").iterdir() if p.is_dir())
    dist.barrier()  # every rank has read the cache before rank 0 damages it
    if rank == 0:  # damage the new weights' cache, named at the end of the line
        victim = Path(changed_line.split(" -> ")[-1]) / "train.npy"
        victim.write_bytes(victim.read_bytes()[:-8])
    dist.barrier()
    repaired, damaged_line = _ensure(config, data)
    return {
        "online": online.history,
        "cached": cached.history,
        "cached_reference": cached.reference,
        "values": values,
        "expected": expected,
        "reuse_line": reuse_line,
        "changed": changed,
        "changed_line": changed_line,
        "repaired": repaired,
        "damaged_line": damaged_line,
        "cache_dirs": cache_dirs,
    }


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("refcache")
    write_jsonl(_records(24, 0), root / "train.jsonl")
    write_jsonl(_records(7, 50), root / "eval.jsonl")
    reference = _perturb(tiny_model_dir, root / "reference", seed=3)
    return run_distributed(_worker, 2, str(root), str(tiny_model_dir), str(reference))


def _losses(history: list[dict], key: str) -> dict[int, float]:
    return {int(h["step"]): h[key] for h in history if key in h}


def test_cached_run_loss_curve_equals_online(result: list[dict]) -> None:
    for rank in result:
        assert rank["cached_reference"] is None  # training with the cache never loaded the reference
        for key in ("train/loss", "train/rewards/chosen", "train/kl", "eval/loss"):
            online, cached = _losses(rank["online"], key), _losses(rank["cached"], key)
            assert sorted(online) == sorted(cached) and len(online) >= 2, key
            # The cache scores packed rows on the plain model, the online reference runs two passes through the
            # plugin: equal within fp32 rounding (~1e-7 nats), which lr 1e-2 grows to ~3e-5 relative by step 3.
            for step in online:
                assert cached[step] == pytest.approx(online[step], rel=1e-4, abs=1e-6), (key, step)
        assert any(abs(v) > 1e-3 for v in _losses(rank["online"], "train/rewards/chosen").values())


def test_cached_values_equal_online_within_1e4_nats(result: list[dict]) -> None:
    values, expected = result[0]["values"], result[0]["expected"]
    for split in ("train", "eval"):
        assert values[split].shape == expected[split].shape
        np.testing.assert_allclose(values[split], expected[split], atol=1e-4, rtol=0)
        assert np.all(values[split] < 0)
    for rank in result:  # every rank reads the same values
        for split in ("train", "eval"):
            np.testing.assert_array_equal(rank["values"][split], values[split])


def test_other_weights_or_damage_recompute_with_one_line(result: list[dict]) -> None:
    r0 = result[0]
    assert r0["reuse_line"].startswith("reference log-probs: reusing ")
    assert len(r0["changed_line"].splitlines()) == 1
    assert (
        "computing 31 examples" in r0["changed_line"]
        and "for another reference_weights" in r0["changed_line"]
    )
    assert len(r0["cache_dirs"]) == 2  # the old weights' cache is kept (switching back reuses it)
    assert np.abs(r0["changed"]["train"] - r0["values"]["train"]).max() > 1e-3  # new weights, new values
    assert "the cache is damaged" in r0["damaged_line"] and "checksum" in r0["damaged_line"]
    np.testing.assert_array_equal(r0["repaired"]["train"], r0["changed"]["train"])
    assert result[1]["reuse_line"] == ""  # one line, from global rank 0 only


def test_precompute_cli_computes_then_reuses_and_names_a_missing_reference(
    tmp_path: Path, tiny_model_dir: Path
):
    import subprocess
    import sys

    import yaml

    write_jsonl(_records(8, 0), tmp_path / "train.jsonl")
    write_jsonl(_records(4, 9), tmp_path / "eval.jsonl")
    raw = _config(tmp_path, tiny_model_dir, tiny_model_dir, "cached").model_dump(mode="json")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    script = (
        "import sys; from coati_kto.cli import main; "
        "codes = [main(['precompute', sys.argv[1]]), main(['precompute', sys.argv[1], sys.argv[2]])]; "
        "print('codes', codes)"
    )
    missing = f"model.reference_path={tmp_path / 'nowhere'}"
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c.yaml"), missing], capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("reference log-probs")]
    assert lines[0].startswith(
        "reference log-probs: computing 12 examples and their KL pairs on 1 rank (no cache"
    )
    assert out.stdout.strip().endswith("codes [0, 2]"), out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    # precompute's preflight names the missing reference before it prepares anything (train's wording)
    assert errors == [
        f"error: model.reference_path: {tmp_path / 'nowhere'} does not exist (a local path; a hub id looks like org/name)"
    ]
