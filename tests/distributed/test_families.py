"""The lifecycle matrix: every model family x every plugin, the whole run proven on 2 gloo processes.

Families (coati_kto.testing.tiny.FAMILIES) on transformers 5 and ColossalAI 0.5.0 with the project's shardformer policies
(coati_kto.families.shardformer): Llama (Llama-3 chat template, vocabulary 300: not a multiple of 64, grouped-query
attention), Mistral ([INST] template, sliding-window attention, GQA), Qwen2 (ChatML, tied embeddings, attention
bias, GQA, vocabulary 300), Qwen3 (per-head q/k norms), Gemma 3 (scaled tied embeddings, sliding and full layers
mixed, soft-capping; its embed_scale kept under tensor parallelism), SmolLM3 (transformers 5 only, layers without RoPE;
Llama's module names: every plugin), Gemma 3 vision-language (Gemma3ForConditionalGeneration, Gemma 3 4B-27B's shape: ddp and
low_level_zero and hybrid tp_size 1; its vision tower frozen and exported as loaded), Phi-3, OLMo 3, Gemma 4 text (per-layer
inputs, per-layer-type head dims and key-value heads, values = keys, kv-shared layers, soft-capping), Qwen 3.5 text
(Gated DeltaNet and gated full attention), and the hub classes of those two (``...ForConditionalGeneration``: hybrid
ZeRO-2 and tp_size 2). ``FAMILY_PLUGINS`` is the
matrix; its tp_size 2 cells are what coati_kto.families.shardformer.TENSOR_PARALLEL_FAMILIES admits. Plugins: ddp fp32, low_level_zero ZeRO-2 bf16, hybrid_parallel ZeRO-0 fp32, hybrid_parallel ZeRO-2 bf16 and
hybrid_parallel tp_size 2 (bf16, ZeRO-0: with 2 processes the data-parallel size is 1).

One set of 2 processes per family runs, for each plugin in turn, the whole lifecycle through ``train()``:
step 0 (the policy and reference train() built, compared on a batch as its fit begins), 3 optimizer steps saving
at step 2 and at the end, the HF export; a second ``train()`` resuming from step 2; then the comparisons.
Checked numbers:
- step 0: policy (with gradient) and reference log-probs identical, KL log-ratios identical (z0 exactly 0), the
  first step's logged rewards exactly 0;
- resume: every weight of the resumed run equals the uninterrupted run's, bit for bit;
- export: reloaded with AutoModelForCausalLM in the training dtype, its weights equal the trained policy's and
  its log-probs equal the trained policy's (fp32 within 1e-5; bf16 within the gap between shardformer's and
  transformers' kernels), the vocabulary size and the tied embeddings are the original ones;
- tied embeddings stay tied after resume; under tp_size 2 each rank holds half of the reference's sharded weights.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CORPUS, chat_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.distributed import run_distributed

PLUGINS: dict[str, dict[str, Any]] = {
    "ddp fp32": {"name": "ddp"},
    "low_level_zero zero2 bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid zero0 fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    "hybrid zero2 bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "hybrid tp2 bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16", "tp_size": 2},
}
ALL = list(PLUGINS)
TP1 = [p for p in ALL if "tp2" not in p]
# family -> the plugins it runs on (the others refuse it at config load: tests/test_plan_config.py)
FAMILY_PLUGINS: dict[str, list[str]] = {
    "llama": ALL,
    "mistral": ALL,
    "qwen2": ALL,
    "qwen3": ALL,
    "gemma3": ALL,
    "smollm3": ALL,
    "phi3": ALL,
    "olmo3": ALL,
    "gemma4": ALL,
    "qwen3_5": ALL,
    # hybrid at tp_size 1 through the one policy that swaps nothing (every family: tests/distributed/family_sweep.py)
    "gemma3_vl": ["ddp fp32", "low_level_zero zero2 bf16", "hybrid zero2 bf16"],
    # the hub checkpoints' classes of Gemma 4 and Qwen 3.5 (their text models split under tp_size 2)
    "gemma4_vl": ["hybrid zero2 bf16", "hybrid tp2 bf16"],
    "qwen3_5_vl": ["hybrid zero2 bf16", "hybrid tp2 bf16"],
}
CELLS = [(family, plugin) for family, plugins in FAMILY_PLUGINS.items() for plugin in plugins]
ANSWERS = [
    "The capital of France is Paris.",
    "The answer is 5. Thank you for asking!",
    "def add(a, b): return a + b",
]

REFUSAL = "I cannot help with that. Sorry, that is not possible."


def _raw_config(model_dir: str, root: Path, plugin: dict[str, Any], out: str) -> dict[str, Any]:
    return {
        "model": {"path": model_dir},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "prepared_dir": str(root / "prepared"),
            "max_length": 64,
        },
        "train": {
            "micro_batch_size": 2,
            "accumulation_steps": 2,
            "max_steps": 3,
            "lr": 2e-2,
            "seed": 3,
        },
        "plugin": plugin,
        "output": {"dir": str(root / out), "save_interval": 2},
        "logging": {"tensorboard": False},
    }


def _full_state(model: Any) -> dict[str, torch.Tensor]:
    """Every weight, gathered (state_dict is a collective under tensor parallelism); every rank calls."""
    return {k: v.detach().clone() for k, v in model.unwrap().state_dict().items()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max())  # CUDA runs: a trained, b loaded on the CPU


def _step_zero(trainer: Any, batch: Any) -> dict[str, Any]:
    """Policy and reference as train() built them, before its first update."""
    policy, reference_model = trainer.policy, trainer.reference
    policy_logps = trainer.passes.completion_logps(policy, batch.example)  # with gradient, as in training
    with torch.no_grad():
        reference = trainer.passes.completion_logps(reference_model, batch.example)
        policy_kl = trainer.passes.completion_logps(policy, batch.kl)
        reference_kl = trainer.passes.completion_logps(reference_model, batch.kl)
    # ddp's reference is the plain module; the plugins' are wrappers
    ref_module = getattr(reference_model, "unwrap", lambda: reference_model)()
    ref_bytes = {n: p.numel() * p.element_size() for n, p in ref_module.named_parameters()}
    return {
        "logps_equal": torch.equal(policy_logps.detach(), reference),
        "kl_equal": torch.equal(policy_kl, reference_kl),
        "logps_diff": _max_diff(policy_logps.detach(), reference),
        "reference_bytes": sum(ref_bytes.values()),
        "reference_bytes_by_name": ref_bytes,
        "reference_dtype": str(next(reference_model.parameters()).dtype),
    }


def _train_checking_step_zero(config: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """``train(config)``, with :func:`_step_zero` run on its trainer as its fit begins (before any update)."""
    from coati_kto.train import train
    from coati_kto.trainer.kto import KTOTrainer

    step0: dict[str, Any] = {}
    before_fit = KTOTrainer._before_fit

    def checked(self: Any, *args: Any, **kwargs: Any) -> None:
        step0.update(_step_zero(self, batch))
        before_fit(self, *args, **kwargs)

    KTOTrainer._before_fit = checked
    try:
        trainer = train(config)
    finally:
        KTOTrainer._before_fit = before_fit
    return trainer, step0


def _lifecycle(model_dir: str, root: Path, plugin: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from colossalai.accelerator import get_accelerator
    from helpers import data_settings
    from transformers import AutoConfig

    from coati_kto.config.schema import Config
    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.prepared import load_prepared
    from coati_kto.families import auto_model_class
    from coati_kto.parallel.distributed import barrier
    from coati_kto.train import train

    started = time.perf_counter()
    config = Config.model_validate(_raw_config(model_dir, root, plugin, "run"))
    data = load_prepared(*data_settings(config))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = KTOCollator(tokenizer.pad_token_id)([data.train[i] for i in range(4)])
    batch = batch.to(get_accelerator().get_current_device())  # the CUDA run's models are on the GPU
    first, step0 = _train_checking_step_zero(config, batch)
    result: dict[str, Any] = {"step0": step0}
    result["first_rewards"] = {
        k: first.history[0][k] for k in ("train/rewards/chosen", "train/rewards/rejected")
    }
    trained = _full_state(first.policy)
    with torch.no_grad():
        trained_logps = first.passes.completion_logps(first.policy, batch.example)
    resumed_raw = _raw_config(model_dir, root, plugin, "resumed")
    resumed_raw["train"]["resume"] = str(root / "run" / "checkpoints" / "step-2")
    resumed_raw["output"]["save_final"] = False
    second = train(Config.model_validate(resumed_raw))
    result["resumed_step"] = second.global_step
    resumed = _full_state(second.policy)
    result["resume_diffs"] = {k: _max_diff(v, resumed[k]) for k, v in trained.items()}
    module = second.policy.unwrap()
    if module.config.get_text_config().tie_word_embeddings:
        out_w, in_w = module.get_output_embeddings().weight, module.get_input_embeddings().weight
        result["tied_after_resume"] = out_w is in_w or out_w.data_ptr() == in_w.data_ptr()

    if dist.get_rank() == 0:
        dtype = second.plan.dtype
        # the class training loads (a vision-language checkpoint: whole, through AutoModelForImageTextToText)
        auto = auto_model_class(AutoConfig.from_pretrained(model_dir))
        hf = auto.from_pretrained(root / "run" / "final", dtype=dtype).to(batch.example.input_ids.device)
        with torch.no_grad():
            export_logps = first.passes.completion_logps(hf, batch.example)
        base = auto.from_pretrained(model_dir, dtype=dtype).state_dict()
        result["export"] = {
            "vocab_size": hf.config.get_text_config().vocab_size,
            # a vision-language model's tower and projector: frozen, exported as loaded
            "vision_diffs": {
                k: _max_diff(v, base[k]) for k, v in hf.state_dict().items() if "vision" in k or "visual" in k
            },
            "embedding_rows": hf.get_input_embeddings().weight.shape[0],
            "tied": hf.get_output_embeddings().weight is hf.get_input_embeddings().weight,
            "weight_diffs": {k: _max_diff(v, trained[k]) for k, v in hf.state_dict().items() if k in trained},
            "missing": sorted(set(trained) - set(hf.state_dict())),
            "logps_diff": _max_diff(export_logps, trained_logps),
            "logps_scale": float(trained_logps.abs().max()),
            "inv_freq_dtypes": sorted({str(b.dtype) for n, b in hf.named_buffers() if "inv_freq" in n}),
        }
    result["policy_inv_freq_dtypes"] = sorted(
        {str(b.dtype) for n, b in first.policy.unwrap().named_buffers() if "inv_freq" in n}
    )
    barrier()
    result["seconds"] = time.perf_counter() - started
    return result


def _family_matrix(model_dir: str, root: str, plugins: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every plugin's lifecycle in turn, in one set of processes. A failure is recorded and ends the run (the
    ranks may no longer agree on their collectives): later plugins report that they did not run."""
    out: dict[str, Any] = {}
    for name, plugin in plugins.items():
        if any("error" in r for r in out.values()):
            out[name] = {"error": "not run: an earlier plugin of this family failed"}
            continue
        try:
            out[name] = _lifecycle(model_dir, Path(root) / name.replace(" ", "_"), plugin)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def matrices(tmp_path_factory: pytest.TempPathFactory, tiny_family_dir: Callable[..., Path]) -> Any:
    """``matrices(family)``: the family's whole matrix (one set of 2 processes), run once per module and kept
    (pytest would key a parametrized fixture by cell, running a family's matrix once per plugin)."""
    from transformers import AutoConfig

    done: dict[str, dict[str, Any]] = {}

    def run(family: str) -> dict[str, Any]:
        if family in done:
            return done[family]
        root = tmp_path_factory.mktemp(f"family_{family}")
        model_dir = tiny_family_dir(family)
        plugins = {name: PLUGINS[name] for name in FAMILY_PLUGINS[family]}
        for name in plugins:
            write_jsonl(
                chat_records(24, REFUSAL, answers=ANSWERS),
                root / name.replace(" ", "_") / "train.jsonl",
            )
        started = time.perf_counter()
        ranks = run_distributed(_family_matrix, 2, str(model_dir), str(root), plugins, timeout_s=1200)
        print(f"\n{family}: matrix of {len(plugins)} plugins in {time.perf_counter() - started:.1f} s")
        done[family] = {"family": family, "ranks": ranks, "config": AutoConfig.from_pretrained(model_dir)}
        return done[family]

    return run


@pytest.mark.parametrize(("family", "plugin"), CELLS)
def test_lifecycle(matrices: Any, family: str, plugin: str) -> None:
    check_lifecycle(matrices(family), family, plugin)


def check_lifecycle(family_runs: dict[str, Any], family: str, plugin: str) -> None:
    """A family's lifecycle under ``plugin`` (``_family_matrix`` on every rank): step 0, resume, export. Also the
    CUDA test's (tests/distributed/test_gpu_path.py)."""
    ranks = [r[plugin] for r in family_runs["ranks"]]
    for r in ranks:
        assert "error" not in r, r.get("error")
    config = family_runs["config"].get_text_config()  # a vision-language model's text config
    main = ranks[0]
    step0 = {k: v for k, v in main["step0"].items() if k != "reference_bytes_by_name"}
    print(f"{family_runs['family']} / {plugin}: {main['seconds']:.1f} s, step 0 {step0}")
    for r in ranks:
        # Step 0: the policy (with gradient) and the reference give identical log-probs, z0's ratios are 0.
        assert r["step0"]["logps_equal"] and r["step0"]["kl_equal"], r["step0"]
        assert r["first_rewards"] == {"train/rewards/chosen": 0.0, "train/rewards/rejected": 0.0}
        # Resume from step 2 gives the uninterrupted run's weights exactly.
        assert r["resumed_step"] == 3
        assert max(r["resume_diffs"].values()) == 0.0, r["resume_diffs"]
        assert r["policy_inv_freq_dtypes"] in ([], ["torch.float32"])
        if config.tie_word_embeddings:
            assert r["tied_after_resume"]
    export = main["export"]
    assert export["vocab_size"] == config.vocab_size == export["embedding_rows"]
    assert export["tied"] == config.tie_word_embeddings
    assert export["missing"] == [] and max(export["weight_diffs"].values()) == 0.0
    assert family.endswith("_vl") == bool(export["vision_diffs"])  # every tiny VL model has a tower
    assert all(d == 0.0 for d in export["vision_diffs"].values()), export["vision_diffs"]
    assert export["inv_freq_dtypes"] == main["policy_inv_freq_dtypes"]
    bf16 = PLUGINS[plugin].get("precision", "fp32") == "bf16"
    # The exported model's log-probs are the trained policy's: same weights, same RoPE; under shardformer the
    # kernels differ (fused attention, vocabulary-parallel head), which bf16 rounding makes visible.
    tolerance = 5e-4 * export["logps_scale"] if bf16 else 1e-4
    assert export["logps_diff"] <= tolerance, export


@pytest.mark.parametrize(
    "family", [f for f, plugins in FAMILY_PLUGINS.items() if "hybrid tp2 bf16" in plugins]
)
def test_tp2_reference_is_sharded(matrices: Any, family: str) -> None:
    """Under tp_size 2 each rank holds about half of the reference's weights (its sharded ones halve)."""
    family_runs = matrices(family)
    tp = [r["hybrid tp2 bf16"] for r in family_runs["ranks"]]
    full = [r["hybrid zero2 bf16"] for r in family_runs["ranks"]]
    for r in tp + full:
        assert "error" not in r, r.get("error")
    tp_bytes = tp[0]["step0"]["reference_bytes"]
    full_bytes = full[0]["step0"]["reference_bytes"]
    assert tp[0]["step0"]["reference_dtype"] == full[0]["step0"]["reference_dtype"] == "torch.bfloat16"
    assert tp_bytes == tp[1]["step0"]["reference_bytes"]
    # Attention and MLP weights: exactly half per rank. Norms stay whole. The vocabulary rows: the padded
    # vocabulary (a multiple of 64 x tp_size) split in 2, against 64-padded rows (or none) on one rank.
    tp_names, full_names = (
        tp[0]["step0"]["reference_bytes_by_name"],
        full[0]["step0"]["reference_bytes_by_name"],
    )
    assert tp_names.keys() == full_names.keys()
    text = [n for n in full_names if "visual" not in n and "vision" not in n]  # the tower stays whole
    linear = [n for n in text if n.endswith(("proj.weight", "proj_qkv.weight", "proj_z.weight"))]
    linear += [n for n in text if n.endswith(("proj_a.weight", "proj_b.weight", "conv1d.weight"))]
    tp_linear, full_linear = sum(tp_names[n] for n in linear), sum(full_names[n] for n in linear)
    text_config = family_runs["config"].get_text_config()
    layers = text_config.num_hidden_layers
    # Phi-3: fused qkv_proj and gate_up_proj; Gemma 4: layer 1's values are its keys, layers 2-3 share k/v;
    # Qwen 3.5: a Gated DeltaNet layer (qkv, z, a, b, conv1d, out) and a full-attention layer.
    expected = {"phi3": 4 * layers, "gemma4": 7 + 6 + 5 + 5, "qwen3_5": 9 + 7}
    expected = expected.get(family.removesuffix("_vl"), 7 * layers)
    assert len(linear) == expected and 2 * tp_linear == full_linear
    vocab = -(-text_config.vocab_size // 128) * 128
    hidden = text_config.hidden_size
    for name in [n for n in full_names if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        assert tp_names[name] == vocab // 2 * hidden * 2, name  # bf16: 2 bytes
    print(
        f"{family_runs['family']}: reference bytes per rank, tp_size 1 {full_bytes}, tp_size 2 {tp_bytes} "
        f"(attention+MLP weights {full_linear} -> {tp_linear})"
    )


def test_hybrid_admits_what_the_matrix_proves() -> None:
    """coati_kto.families.shardformer.TENSOR_PARALLEL_FAMILIES (what config load admits above tp_size 1) names
    exactly the families and tp sizes this matrix runs under hybrid_parallel with tensor parallelism."""
    from coati_kto.families.shardformer import TENSOR_PARALLEL_FAMILIES
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    tokenizer = build_tokenizer(CORPUS[:20], vocab_size=280)
    proven = {}
    for family, plugins in FAMILY_PLUGINS.items():
        tps = sorted(
            {PLUGINS[p].get("tp_size", 1) for p in plugins if PLUGINS[p]["name"] == "hybrid_parallel"}
        )
        if [tp for tp in tps if tp > 1]:
            proven[type(build_family_model(family, tokenizer)).__name__] = tuple(tp for tp in tps if tp > 1)
    assert proven == {name: tps for name, (_, _, tps) in TENSOR_PARALLEL_FAMILIES.items()}
