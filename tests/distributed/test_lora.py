"""``model.lora``: KTO on peft adapters through ``booster.enable_lora``, on 2 gloo processes, per plugin.

Each plugin's run, from the train() entry point: only adapter parameters train; the reference (the policy with
its adapters disabled) equals the policy exactly at step 0, so the first step's rewards are exactly 0; the
reward margin rises on the e2e preference task; a resume from the middle checkpoint ends with bit-equal
adapters; the PEFT adapter directory and the merged model reload and reproduce the trained policy's log-probs.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import MINIMAL, preference_records, write_config

from coati_kto.config.load import load_config
from coati_kto.data.files import write_jsonl
from coati_kto.errors import ConfigError
from coati_kto.testing.distributed import run_distributed

PLUGINS: dict[str, dict[str, Any]] = {
    "ddp": {"name": "ddp"},
    "low_level_zero": {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"},
    "hybrid_parallel": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}
STEPS = 6


def _raw_config(model_dir: str, root: Path, plugin: dict[str, Any], out: str) -> dict[str, Any]:
    return {
        "model": {"path": model_dir, "lora": {"rank": 4, "alpha": 8, "dropout": 0.1}},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "eval_files": [str(root / "eval.jsonl")],
            "prepared_dir": str(root / "prepared"),
            "max_length": 96,
            "max_prompt_length": 48,
        },
        "train": {"micro_batch_size": 4, "max_steps": STEPS, "lr": 3e-2, "seed": 5},
        "plugin": plugin,
        "output": {"dir": str(root / out), "save_interval": 3, "merge_lora": True},
        "logging": {"tensorboard": False},
    }


def _adapters(policy: Any) -> dict[str, torch.Tensor]:
    from coati_kto.models.lora import peft_model

    return {n: p.detach().float().clone() for n, p in peft_model(policy).named_parameters() if "lora_" in n}


def _lifecycle(model_dir: str, root: Path, plugin: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from helpers import data_settings
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.prepared import load_prepared
    from coati_kto.models.lora import peft_model
    from coati_kto.parallel.distributed import barrier
    from coati_kto.train import train

    config = Config.model_validate(_raw_config(model_dir, root, plugin, "run"))
    first = train(config)
    result: dict[str, Any] = {}
    train_records = [h for h in first.history if "train/loss" in h]
    result["rewards"] = [
        (h["train/rewards/chosen"], h["train/rewards/rejected"], h["train/rewards/margins"])
        for h in train_records
    ]
    result["eval_margins"] = {
        int(h["step"]): h["eval/rewards/margins"] for h in first.history if "eval/loss" in h
    }
    peft = peft_model(first.policy)
    result["trainable"] = sorted(n for n, p in peft.named_parameters() if p.requires_grad)
    result["frozen_lora"] = sorted(
        n for n, p in peft.named_parameters() if "lora_" in n and not p.requires_grad
    )
    result["reference_is_policy"] = first.reference.policy is first.policy
    # The chunked LM head path (no [B, S, V] logits) finds the head through the PeftModel.
    result["chunked_head"] = first.passes._lm_head(first.policy) is not None
    trained = _adapters(first.policy)
    data = load_prepared(*data_settings(config))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = KTOCollator(tokenizer.pad_token_id)([data.train[i] for i in range(4)])
    with torch.no_grad():
        trained_logps = first.passes.completion_logps(first.policy, batch.example)
        base_logps = first.passes.completion_logps(first.reference, batch.example)

    resumed_raw = _raw_config(model_dir, root, plugin, "resumed")
    resumed_raw["train"]["resume"] = str(root / "run" / "checkpoints" / "step-3")
    resumed_raw["output"].update(save_final=False, merge_lora=False)  # merge_lora without final/: refused
    second = train(Config.model_validate(resumed_raw))
    resumed = _adapters(second.policy)
    result["resumed_step"] = second.global_step
    result["resume_equal"] = sorted(trained) == sorted(resumed) and all(
        torch.equal(v, resumed[k]) for k, v in trained.items()
    )
    result["adapter_count"] = len(trained)

    if dist.get_rank() == 0:
        dtype = first.plan.dtype
        final = root / "run" / "final"
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        adapted = PeftModel.from_pretrained(base, final / "adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(final / "merged", dtype=dtype).eval()
        with torch.no_grad():
            result["adapter_diff"] = float(
                (first.passes.completion_logps(adapted, batch.example) - trained_logps).abs().max()
            )
            result["merged_diff"] = float(
                (first.passes.completion_logps(merged, batch.example) - trained_logps).abs().max()
            )
        result["trained_vs_base"] = float((trained_logps - base_logps).abs().max())
        result["logps_scale"] = float(trained_logps.abs().max())
        result["merged_has_lora"] = any("lora_" in k for k in merged.state_dict())
        result["card_uses_adapter"] = "PeftModel.from_pretrained" in (final / "README.md").read_text()
    barrier()
    return result


def _matrix(model_dir: str, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, plugin in PLUGINS.items():
        if any("error" in r for r in out.values()):
            out[name] = {"error": "not run: an earlier plugin failed"}
            continue
        try:
            out[name] = _lifecycle(model_dir, Path(root) / name, plugin)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def lora_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("lora")
    for name in PLUGINS:
        write_jsonl(preference_records(48, 0), root / name / "train.jsonl")
        write_jsonl(preference_records(9, 100), root / name / "eval.jsonl")
    return run_distributed(_matrix, 2, str(tiny_model_dir), str(root))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_lora_lifecycle(lora_runs: list[dict[str, Any]], plugin: str) -> None:
    main = lora_runs[0][plugin]
    assert "error" not in main, main["error"]
    rewards = main["rewards"]
    assert len(rewards) == STEPS
    # B starts at zero: the adapter-free reference is the policy, so step 1 (before any update) rewards are 0.
    assert rewards[0][0] == 0.0 and rewards[0][1] == 0.0, rewards[0]
    margins = [m for _, _, m in rewards]
    assert sum(margins[-2:]) / 2 > margins[0] + 0.05, margins
    # Held-out prompts: the step-0 baseline is exactly 0 (reference == policy), the trained adapters prefer
    # the desirable answers.
    evals = main["eval_margins"]
    assert sorted(evals) == [0, STEPS] and evals[0] == 0.0 and evals[STEPS] > 0.1, evals
    # Only the adapters train; every adapter trains.
    assert main["trainable"] and all("lora_A" in n or "lora_B" in n for n in main["trainable"])
    assert main["frozen_lora"] == [] and main["reference_is_policy"] and main["chunked_head"]
    assert main["resumed_step"] == STEPS and main["resume_equal"], main
    assert lora_runs[1][plugin]["resume_equal"]
    # The adapters moved the policy away from the base, and both exports reproduce the trained policy.
    assert main["trained_vs_base"] > 1e-3
    tolerance = 1e-4 if plugin == "ddp" else 2e-2 * max(1.0, main["logps_scale"])
    assert main["adapter_diff"] <= tolerance, main
    assert main["merged_diff"] <= max(tolerance, 1e-3), main
    assert not main["merged_has_lora"] and main["card_uses_adapter"]


def _packed_run(model_dir: str, root: str, pack_policy: bool, padding_free: bool = False) -> dict[str, Any]:
    """Two steps of LoRA on hybrid_parallel ZeRO-2 bf16 with kto.pack_reference: the adapter-free reference
    runs its shared-prompt pass through the plugin's wrapper; with pack_policy the policy folds too."""
    import coati_kto.models.packing as packing
    import coati_kto.trainer.passes as passes
    from coati_kto.config.schema import Config
    from coati_kto.train import train

    calls: list[str] = []
    packed = packing.packed_logps

    def counted(model: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(model).__name__)
        return packed(model, *args, **kwargs)

    raw = _raw_config(model_dir, Path(root), PLUGINS["hybrid_parallel"], f"packed-{pack_policy}")
    raw["data"].pop("eval_files")
    raw["train"]["max_steps"] = 2
    raw["kto"] = {"pack_reference": True, "pack_policy": pack_policy, "kl_continuation": False}
    raw["data"]["padding_free"] = padding_free
    raw["output"] = {"dir": str(Path(root) / f"packed-{pack_policy}"), "save_final": False}
    # Counted where the trainer looks it up too: passes binds it at import, which comes before this task in a
    # worker that imported the package already (the worker pool's ranks preload it).
    packing.packed_logps = passes.packed_logps = counted
    try:
        trainer = train(Config.model_validate(raw))
    finally:
        packing.packed_logps = passes.packed_logps = packed
    first = next(h for h in trainer.history if "train/loss" in h)
    return {"calls": calls, "rewards": (first["train/rewards/chosen"], first["train/rewards/rejected"])}


def _continued_run(model_dir: str, root: str) -> dict[str, Any]:
    """Two steps of LoRA on hybrid_parallel ZeRO-2 bf16 with kto.kl_continuation (the default): the policy's
    KL passes continue from its gradient passes' cache, the adapter-free reference's from its own."""
    import coati_kto.trainer.passes as passes
    from coati_kto.config.schema import Config
    from coati_kto.train import train

    calls: list[str] = []
    originals = {name: getattr(passes, name) for name in ("continued_logps", "continued_kl_logps")}

    def counting(name: str) -> Any:
        def counted(model: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(f"{name} {type(model).__name__}")
            return originals[name](model, *args, **kwargs)

        return counted

    raw = _raw_config(model_dir, Path(root), PLUGINS["hybrid_parallel"], "continued")
    raw["data"].pop("eval_files")
    raw["train"]["max_steps"] = 2
    raw["output"] = {"dir": str(Path(root) / "continued"), "save_final": False}
    for name in originals:
        setattr(passes, name, counting(name))
    try:
        trainer = train(Config.model_validate(raw))
    finally:
        for name, original in originals.items():
            setattr(passes, name, original)
    first = next(h for h in trainer.history if "train/loss" in h)
    return {"calls": calls, "first": first}


def test_kl_continuation_through_a_lora_hybrid_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Both models' KL passes continue through the plugin's wrapper and the adapter-free reference; before any
    update the policy equals its reference on the same path: rewards and KL exactly 0 at step 1."""
    write_jsonl(preference_records(48, 0), tmp_path / "train.jsonl")
    for run in run_distributed(_continued_run, 2, str(tiny_model_dir), str(tmp_path)):
        assert (
            run["calls"]
            == ["continued_logps AdapterFreeReference", "continued_kl_logps HybridParallelModule"] * 2
        )
        first = run["first"]
        assert first["train/rewards/chosen"] == 0.0 and first["train/rewards/rejected"] == 0.0, first
        assert first["train/kl_raw"] == 0.0, first


@pytest.mark.parametrize("pack_policy,padding_free", [(False, False), (True, False), (True, True)])
def test_packed_passes_through_a_lora_hybrid_policy(
    tiny_model_dir: Path, tmp_path: Path, pack_policy: bool, padding_free: bool
) -> None:
    write_jsonl(preference_records(48, 0), tmp_path / "train.jsonl")
    runs = run_distributed(_packed_run, 2, str(tiny_model_dir), str(tmp_path), pack_policy, padding_free)
    for run in runs:
        # one packed reference pass per step, no fallback to two passes
        assert run["calls"].count("AdapterFreeReference") == 2, run
        # Before any update the policy equals its adapter-free reference: a packed pass differs from the
        # policy's own pass by bf16 rounding only (per-sequence sums of ~10 tokens).
        assert all(abs(r) < 5e-3 for r in run["rewards"]), run
    policy_folds = sum(run["calls"].count("HybridParallelModule") for run in runs)
    # These prompts are long enough for some micro-batches to fold the policy's KL pass (the LoRA policy's
    # packed gradient pass through the plugin), and none without pack_policy.
    assert policy_folds >= 1 if pack_policy else policy_folds == 0, runs


def test_lora_config_checks(tmp_path: Path) -> None:
    path = write_config(tmp_path, MINIMAL)
    config = load_config(path, ["model.lora={rank: 4}"])
    assert config.model.lora.rank == 4 and config.model.lora.target_modules == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]
    with pytest.raises(ConfigError, match="model.lora with plugin.tp_size 2"):
        load_config(path, ["model.lora={rank: 4}", "plugin.tp_size=2"])
    with pytest.raises(ConfigError, match="output.merge_lora needs model.lora"):
        load_config(path, ["output.merge_lora=true"])
    with pytest.raises(ConfigError, match="lm_head: adapters on the embeddings or LM head"):
        load_config(path, ["model.lora={target_modules: [q_proj, lm_head]}"])
    with pytest.raises(ConfigError, match="model.reference_path with model.lora"):
        load_config(path, ["model.lora={rank: 4}", f"model.reference_path={tmp_path}"])


def _moe_experts_run(model_dir: str, root: str) -> dict[str, Any]:
    """Two steps of LoRA on a Qwen3-MoE's fused expert parameters (peft maps gate_proj/up_proj/down_proj onto
    them: ParamWrapper) under low_level_zero ZeRO-2 bf16."""
    from coati_kto.config.schema import Config
    from coati_kto.models.lora import peft_model
    from coati_kto.train import train

    raw = _raw_config(
        model_dir, Path(root), {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, "moe"
    )
    raw["model"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    raw["data"].pop("eval_files")
    raw["train"]["max_steps"] = 2
    raw["output"] = {"dir": str(Path(root) / "moe"), "save_final": False}
    trainer = train(Config.model_validate(raw))
    first = next(h for h in trainer.history if "train/loss" in h)
    peft = peft_model(trainer.policy)
    lora_b = {n: float(p.detach().float().abs().max()) for n, p in peft.named_parameters() if "lora_B" in n}
    return {
        "rewards": (first["train/rewards/chosen"], first["train/rewards/rejected"]),
        "trainable": sorted(n for n, p in peft.named_parameters() if p.requires_grad),
        "lora_b": lora_b,
    }


def test_lora_on_moe_experts_under_zero2(tmp_path: Path) -> None:
    """ColossalAI 0.5.0's LowLevelZeroPlugin looked each adapter's base up as '<module>.base_layer.weight' and
    raised KeyError for peft's ParamWrapper (coati_kto.parallel.upstream.fixes fixes the lookup)."""
    from helpers import CORPUS
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from coati_kto.testing.tiny import build_tokenizer, random_causal_lm

    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    model = random_causal_lm(
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        vocab_size=len(tokenizer),
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    write_jsonl(preference_records(48, 0), tmp_path / "train.jsonl")
    runs = run_distributed(_moe_experts_run, 2, str(tmp_path / "model"), str(tmp_path))
    for run in runs:
        assert run["rewards"] == (0.0, 0.0), run  # B starts at zero: the adapter-free reference is the policy
        # Only the experts' adapters train, in both layers, and every B moved away from zero.
        assert run["trainable"] and all(".mlp.experts." in n and "lora_" in n for n in run["trainable"]), run
        assert {n.split(".mlp.")[0] for n in run["trainable"]} == {
            f"base_model.model.model.layers.{i}" for i in (0, 1)
        }, run
        assert run["lora_b"] and all(v > 0 for v in run["lora_b"].values()), run
    assert runs[0]["lora_b"] == runs[1]["lora_b"]  # the ranks hold the same adapters
