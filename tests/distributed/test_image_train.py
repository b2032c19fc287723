"""Image feedback end to end (issue 49, Gemma 3): a TRL image dataset (content parts, images as relative PNG
paths) on the tiny Gemma 3 VL model and its processor (coati_kto.testing.tiny_processors.write_gemma3_vl),
through the real ``coati-kto`` commands on the default plugin (hybrid_parallel, ZeRO 2), fp32, SGD (a wrong
gradient scale shows in the weights):

- prepare, then train 3 steps on one process: step 1's rewards and KL are exactly 0 (the online reference shares
  the policy's image features), and the default ``kto.kl_continuation`` falls back to the padded KL pass, said
  once;
- a resume from step 1 ends bit for bit where the uninterrupted run did;
- 2 processes (ZeRO 2 over dp 2) equal one process within fp32 summation order (same_seed_runs' bounds);
- the cached reference (scored with the images) logs the online run's metrics;
- the default config (bf16) with only the paths set trains and exports the processor;
- final/ reloads with AutoProcessor and AutoModelForImageTextToText and scores the eval split as the run's last
  evaluation did;
- LoRA adapts the language model only, and its adapter and merged exports score as the run; its evaluation
  samples, generated with their images, log each image to TensorBoard and an image column to W&B (offline).

One module fixture: one prepare, six training launches of a few seconds each and one for the refusals (the
suite's time budget).

Gemma 4 and Qwen 3.5 (their processors without a video processor, their image token counts varying with the
images' sizes: coati_kto.data.processors), one launch for both: prepare, 3 steps, a resume from step 1 ending bit
for bit, and final/ scoring the eval split as the last evaluation did.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from same_seed_runs import (
    METRIC_BOUND,
    UPDATE_BOUND,
    assert_same_metrics,
    assert_step1_rewards_and_kl_zero,
    logged_metrics,
    sgd_train,
)
from same_seed_runs import final_weights as _weights

from coati_kto.testing.cli import run_cli
from coati_kto.testing.tiny_processors import write_gemma3_vl, write_vl

SAMPLES = 2  # eval.samples of the LoRA run
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 220), "yellow": (240, 230, 30)}
FALLBACK = (
    "kto.kl_continuation: off for image records (the KL pairs run their own padded pass with the images)"
)


def _records(root: Path, n: int, offset: int, name: str) -> Path:
    """``n`` TRL records (an image part then a question; images as paths relative to the data file), labels
    alternating: the right colour or the next one."""
    (root / "images").mkdir(exist_ok=True)
    names = list(COLOURS)
    lines = []
    for i in range(offset, offset + n):
        colour = names[i % 4]
        path = root / "images" / f"{colour}-{i % 3}.png"
        if not path.exists():
            shade = tuple(max(0, c - 25 * (i % 3)) for c in COLOURS[colour])
            Image.new("RGB", (32 + 8 * (i % 3), 32), shade).save(path, "PNG")
        good = i % 2 == 0
        question = {"type": "text", "text": f"What colour is the shape? ({i})"}
        lines.append(
            {
                "prompt": [{"role": "user", "content": [{"type": "image"}, question]}],
                "completion": [{"role": "assistant", "content": colour if good else names[(i + 1) % 4]}],
                "label": good,
                "images": [f"images/{path.name}"],
            }
        )
    out = root / name
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def _mixed_records(root: Path, n: int, name: str) -> Path:
    """``n`` records, one in three with an image (as ``_records``'), the others text only: most micro-batches hold
    no image, so with model.train_vision a rank's backward may reach the tower while its peer's does not."""
    imaged = [json.loads(line) for line in _records(root, n, 0, f"imaged-{name}").read_text().splitlines()]
    lines = []
    for i, record in enumerate(imaged):
        if i % 3 != 0:
            good = i % 2 == 0
            record = {
                "prompt": [{"role": "user", "content": f"What colour is the sky? ({i})"}],
                "completion": [{"role": "assistant", "content": "blue" if good else "green"}],
                "label": good,
            }
        lines.append(json.dumps(record) + "\n")
    out = root / name
    out.write_text("".join(lines))
    return out


# Refused right after prepare, before any model loads (the messages: coati_kto.recipe.images). data.padding_free,
# plugin.sp_size and plugin.pp_size are refused earlier for this model, at config load (not proven for Gemma 3).
REFUSALS = {
    "kto.pack_policy=true": "kto.pack_policy true: image records cannot run with a packed pass: its mask has no "
    "image block; set it to auto",
    "kto.pack_reference=true": "kto.pack_reference true: image records cannot run with a packed pass: its mask has "
    "no image block; set it to false",
    "model.compile=true": "model.compile true: image records cannot run with compiled layers; set it to false",
}


def _each(argv: list[str]) -> int:
    """``coati-kto train CONFIG`` with each override of ``argv[2:]`` in turn, output.dir under ``argv[1]`` (one
    launch for every refusal); prints their exit statuses."""
    from coati_kto.cli import main

    config, out = argv[0], argv[1]
    codes = [main(["train", config, o, f"output.dir={out}/{i}"]) for i, o in enumerate(argv[2:])]
    print("exit statuses", codes)
    return 0


def _lifecycle(roots: list[str]) -> int:
    """prepare, train 3 steps (plain SGD), resume from step 1 and train with the cached reference, in each of
    ``roots`` (its ``one.yaml``, ``resumed.yaml`` and ``cached.yaml``); prints each root's exit statuses (one
    launch for the families' lifecycles)."""
    from coati_kto.cli import main

    for root in roots:
        codes = [main(["prepare", f"{root}/one.yaml"])]
        codes += [sgd_train(["train", f"{root}/{run}.yaml"]) for run in ("one", "resumed", "cached")]
        print(f"exit statuses {Path(root).name} {codes}")
    return 0


def _sgd_train_counting_zero_filled(argv: list[str]) -> int:
    """``sgd_train``, then prints how many gradients no rank's backward reached (left out of the step) and how many
    this rank's backwards left out and the ordered reduction filled with zeros (``-1``: no ordered reduction)."""
    import coati_kto.parallel.backends.base as backends

    install, optimizers = backends.install_ordered_reduction, []

    def recording(optimizer: Any) -> bool:
        optimizers.append(optimizer)
        return install(optimizer)

    backends.install_ordered_reduction = recording  # put back by the pool's reset
    code = sgd_train(argv)
    counts = [
        getattr(optimizers[0], f"{k}_grads", -1) if optimizers else -1 for k in ("unreached", "zero_filled")
    ]
    print("unreached by every rank", counts[0], "zero-filled gradients", counts[1])
    return code


def _config(root: Path, out: str, kto: dict | None = None, **train: Any) -> Path:
    """The default config with model.path a Gemma 3 VL model; fp32 so that runs compare closely."""
    config = {
        "model": {"path": str(root / "model")},
        "data": {
            "train_files": [str(root / "train.jsonl")],
            "eval_files": [str(root / "eval.jsonl")],
            "prepared_dir": str(root / "prepared"),
        },
        "kto": {"beta": 0.5, **(kto or {})},
        "train": {
            "seed": 3,
            "micro_batch_size": 2,
            "accumulation_steps": 2,
            "max_steps": 3,
            "lr": 0.5,
            "warmup_steps": 0,
            "eval_interval": 1,
            **train,
        },
        "plugin": {"precision": "fp32"},
        "output": {"dir": str(root / out), "save_interval": 1, "keep_last": 3},
        "logging": {"tensorboard": True},
    }
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, world: int, *overrides: str, command: Any = sgd_train) -> str:
    proc = run_cli(["train", str(config), *overrides], world, command=command)
    assert proc.returncode == 0, proc.ranks[0].stdout[-3000:] + proc.ranks[0].stderr[-3000:]
    return "".join(rank.stdout for rank in proc.ranks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("image_train")
    write_gemma3_vl(root / "model")
    _records(root, 16, 0, "train.jsonl")
    _records(root, 4, 100, "eval.jsonl")
    prepared = run_cli(["prepare", str(_config(root, "one"))])
    assert prepared.returncode == 0, prepared.ranks[0].stderr[-3000:]
    stdout = {"prepare": prepared.ranks[0].stdout}
    stdout["one"] = _train(_config(root, "one"), 1)
    step1 = str(root / "one" / "checkpoints" / "step-1")
    stdout["resumed"] = _train(_config(root, "resumed", resume=step1), 1)
    stdout["two"] = _train(_config(root, "two", accumulation_steps=1), 2)
    stdout["cached"] = _train(_config(root, "cached", kto={"reference": "cached"}), 1)
    # LoRA, and evaluation samples with their images to TensorBoard and W&B (offline)
    lora = yaml.safe_load(_config(root, "lora").read_text())
    lora["model"]["lora"] = {"rank": 4, "alpha": 8}
    lora["output"]["merge_lora"] = True
    lora["eval"] = {"samples": SAMPLES, "sample_max_new_tokens": 3}
    lora["logging"] = {"tensorboard": True, "wandb": True, "wandb_mode": "offline"}
    (root / "lora.yaml").write_text(yaml.safe_dump(lora))
    stdout["lora"] = _train(root / "lora.yaml", 1)
    for name, world, steps in (("vision_one", 1, 2), ("vision_two", 2, 1)):  # model.train_vision
        vision = yaml.safe_load(_config(root, name, accumulation_steps=steps).read_text())
        vision["model"]["train_vision"] = True
        (root / f"{name}.yaml").write_text(yaml.safe_dump(vision))
        stdout[name] = _train(root / f"{name}.yaml", world)
    # model.train_vision on text and image records mixed (ZeRO 1 over dp 2 against one process)
    _mixed_records(root, 16, "mixed.jsonl")
    for name, world, steps in (("mixed_one", 1, 2), ("mixed_two", 2, 1)):
        mixed = yaml.safe_load(_config(root, name, accumulation_steps=steps).read_text())
        mixed["model"]["train_vision"] = True
        mixed["data"].update(
            train_files=[str(root / "mixed.jsonl")], prepared_dir=str(root / "prepared-mixed")
        )
        mixed["plugin"] = {"name": "low_level_zero", "zero_stage": 1, "precision": "fp32"}  # ZeRO's buckets
        (root / f"{name}.yaml").write_text(yaml.safe_dump(mixed))
        stdout[name] = _train(root / f"{name}.yaml", world, command=_sgd_train_counting_zero_filled)
    default = {  # nothing but the paths: the default plugin, precision (bf16) and kto settings
        "model": {"path": str(root / "model")},
        "data": {"train_files": [str(root / "train.jsonl")], "prepared_dir": str(root / "prepared-default")},
        "train": {"max_steps": 2},
        "output": {"dir": str(root / "default")},
        "logging": {"tensorboard": True},
    }
    (root / "default.yaml").write_text(yaml.safe_dump(default))
    stdout["default"] = _train(root / "default.yaml", 1)
    refused = run_cli([str(root / "one.yaml"), str(root / "refused"), *REFUSALS], command=_each)
    return {"root": root, "stdout": stdout, "refused": refused.ranks[0]}


def test_prepare_reads_the_images_and_one_process_starts_at_exactly_zero(runs: dict) -> None:
    assert "    images per record: 16 with 1; image tokens 64 (" in runs["stdout"]["prepare"]
    assert runs["stdout"]["one"].splitlines().count(FALLBACK) == 1
    assert_step1_rewards_and_kl_zero(runs["root"] / "one")
    metrics = logged_metrics(runs["root"] / "one")
    assert [s for s, _ in metrics["eval/loss"]] == [0, 1, 2, 3]
    assert dict(metrics["train/kl"])[3] != 0.0  # it trained: the policy moved from the reference


def test_a_resume_from_step_1_ends_bit_for_bit_where_the_uninterrupted_run_did(runs: dict) -> None:
    root = runs["root"]
    got, want = _weights(root / "resumed"), _weights(root / "one")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    resumed, whole = logged_metrics(root / "resumed"), logged_metrics(root / "one")
    for tag, values in resumed.items():
        assert values == [(s, v) for s, v in whole[tag] if s >= 2], tag


def _tower(name: str) -> bool:
    return "vision_tower" in name or "multi_modal_projector" in name


def test_two_processes_equal_one_process(runs: dict) -> None:
    """The frozen tower and projector are exported as loaded (bit for bit); every trained tensor's update within
    same_seed_runs' bound (the frozen ones, updated by 0, are left out of that ratio)."""
    root = runs["root"]
    start = load_file(root / "model" / "model.safetensors")
    for run in ("one", "two"):
        final = _weights(root / run)
        frozen = [k for k in final if _tower(k)]
        assert frozen and all(torch.equal(final[k], start[k]) for k in frozen)
        assert all(not torch.equal(final[k], start[k]) for k in final if not _tower(k) and "norm" not in k)
    got, want = _weights(root / "two"), _weights(root / "one")
    errors = {}
    for k in want:
        if _tower(k):
            continue
        spacing = torch.finfo(torch.float32).eps * want[k].abs().max().item()
        difference = max((got[k] - want[k]).abs().max().item() - spacing, 0.0)
        errors[k] = difference / (want[k] - start[k]).abs().max().item()
    assert max(errors.values()) < UPDATE_BOUND, max(errors.items(), key=lambda kv: kv[1])
    assert_same_metrics(
        root / "two", root / "one", {"train/loss", "train/kl", "eval/loss", "eval/logps/chosen"}
    )


def test_train_vision_moves_the_tower_and_two_processes_equal_one(runs: dict) -> None:
    """model.train_vision: the tower and projector train (their gradient through the features computed outside the
    wrapped forward reaches ZeRO's reduction on 2 processes); step 1 starts at exactly 0; 2 processes' update
    equals 1 process's for every tensor, the tower's included."""
    root = runs["root"]
    start = load_file(root / "model" / "model.safetensors")
    assert_step1_rewards_and_kl_zero(root / "vision_one")
    got, want = _weights(root / "vision_two"), _weights(root / "vision_one")
    moved = [k for k in want if _tower(k) and not torch.equal(want[k], start[k])]
    assert len(moved) > 10 and any("multi_modal_projector" in k for k in moved)
    _assert_every_update_equal(got, want, start)


def _assert_every_update_equal(got: dict, want: dict, start: dict) -> None:
    """Every tensor's update in ``got`` equals ``want``'s within same_seed_runs' bound; one not updated in
    ``want`` (no gradient) is not updated in ``got`` either; an attention key bias (the tower's) in neither, but
    for rounding."""
    errors = {}
    for k in want:
        update = (want[k] - start[k]).abs().max().item()
        if update == 0.0:  # the tower's unused head: no gradient in either run
            assert torch.equal(got[k], start[k]), k
            continue
        if k.endswith(
            "k_proj.bias"
        ):  # softmax ignores a bias added to every key: its gradient is rounding only
            assert max(update, (got[k] - start[k]).abs().max().item()) < 1e-9, k
            continue
        spacing = torch.finfo(torch.float32).eps * want[k].abs().max().item()
        errors[k] = max((got[k] - want[k]).abs().max().item() - spacing, 0.0) / update
    assert max(errors.values()) < UPDATE_BOUND, max(errors.items(), key=lambda kv: kv[1])


def test_train_vision_on_text_and_image_records_two_processes_equal_one(runs: dict) -> None:
    """model.train_vision on a mix of text and image records: a step where one rank's micro-batch holds an image
    and its peer's none still reduces every gradient together (ZeRO's buckets filled alike: the ordered
    reduction, coati_kto.parallel.ordered_grads); 2 processes' update equals 1 process's, the tower's included."""
    root = runs["root"]
    start = load_file(root / "model" / "model.safetensors")
    # In the 2-process run a rank's backward left the tower out while its peer's reached it (a micro-batch of text
    # records only beside one with an image): the ordered reduction filled those gradients with zeros. And in a step
    # with no image on either rank no backward reached the tower: it was left out of the step, as on one process.
    counts = [line.split() for line in runs["stdout"]["mixed_two"].splitlines() if "zero-filled" in line]
    filled, unreached = [int(c[-1]) for c in counts], [int(c[4]) for c in counts]
    assert len(counts) == 2 and max(filled) > 0 and min(unreached) > 0, counts
    got, want = _weights(root / "mixed_two"), _weights(root / "mixed_one")
    assert any(_tower(k) and not torch.equal(want[k], start[k]) for k in want)  # the tower trained
    _assert_every_update_equal(got, want, start)


def test_the_cached_reference_scored_with_the_images_logs_the_online_metrics(runs: dict) -> None:
    both = "kto.kl_continuation and kto.pack_policy auto: off for image records"
    assert runs["stdout"]["cached"].count(both) == 1
    assert_same_metrics(
        runs["root"] / "cached", runs["root"] / "one", {"train/loss", "train/kl", "eval/loss"}
    )


def test_final_reloads_with_its_processor_and_scores_as_the_last_evaluation(runs: dict) -> None:
    """AutoProcessor and AutoModelForImageTextToText on final/: the eval split's ids (the processor's) and its
    pixels through the plain pixel_values forward give the mean log-probs the run logged at its last step."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, Gemma3Processor

    root = runs["root"]
    final = root / "one" / "final"
    processor = AutoProcessor.from_pretrained(final)
    model = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    assert isinstance(processor, Gemma3Processor)
    card = (final / "README.md").read_text()
    assert "the vision tower and projector stay frozen (no gradient, no optimizer state)" in card
    assert 'processor = AutoProcessor.from_pretrained("path/to/final")' in card
    _assert_scores_as_the_last_evaluation(root, final, processor, model)


def _assert_scores_as_the_last_evaluation(root: Path, final: Path, processor: Any, model: Any) -> None:
    """The eval split's ids (the processor's) and pixels through the plain forward give the mean log-probs the
    run logged at its last step (within 1e-4 relative)."""
    sums = {True: [], False: []}
    for line in (root / "eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        image = Image.open(io.BytesIO((root / record["images"][0]).read_bytes()))
        prompt = processor.apply_chat_template(record["prompt"], add_generation_prompt=True)
        whole = processor.apply_chat_template(record["prompt"] + record["completion"])
        inputs = processor(text=[whole], images=[[image]], return_tensors="pt")
        start = len(processor(text=[prompt], images=[[image]])["input_ids"][0])
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[0, start - 1 : -1].float()
        targets = inputs["input_ids"][0, start:]
        logps = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).sum()
        sums[record["label"]].append(float(logps))
    logged = logged_metrics(final.parent)
    for label, tag in ((True, "eval/logps/chosen"), (False, "eval/logps/rejected")):
        want = dict(logged[tag])[3]
        got = sum(sums[label]) / len(sums[label])
        assert abs(got - want) <= 1e-4 * abs(want), (tag, got, want)


def test_each_setting_images_cannot_run_with_is_refused_in_one_line_after_prepare(runs: dict) -> None:
    refused = runs["refused"]
    assert "exit statuses [2, 2, 2]" in refused.stdout
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {message}" for message in REFUSALS.values()]
    assert "Traceback" not in refused.stderr


def test_the_default_config_trains_on_images(runs: dict) -> None:
    from transformers import AutoProcessor

    root = runs["root"]
    assert runs["stdout"]["default"].splitlines().count(FALLBACK) == 1
    assert_step1_rewards_and_kl_zero(root / "default")
    assert AutoProcessor.from_pretrained(root / "default" / "final").image_seq_length == 4


def test_lora_adapts_the_language_model_only_and_both_exports_score_as_the_run(runs: dict) -> None:
    """The default targets on a vision-language model: a regex over its language model (8 adapters on the tiny
    Gemma 3, none in the SigLIP tower); step 1's rewards and KL are exactly 0 (B starts at zero); the base, the
    tower and the projector stay as loaded; final/adapter reloads with peft and final/merged as the hub class,
    and each scores the eval split as the run's last evaluation did; the card's Use section names those classes
    (it named AutoModelForCausalLM, and an AutoTokenizer it did not import)."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor, Gemma3ForConditionalGeneration

    root = runs["root"]
    final = root / "lora" / "final"
    adapter_config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == r".*model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj)"
    adapters = load_file(final / "adapter" / "adapter_model.safetensors")
    adapted = {k.split(".lora_")[0] for k in adapters}
    assert len(adapted) == 8 and all(".language_model.layers." in k for k in adapted), sorted(adapted)
    assert all(torch.count_nonzero(v) for k, v in adapters.items() if "lora_B" in k)  # every adapter trained
    assert_step1_rewards_and_kl_zero(root / "lora")
    start = load_file(root / "model" / "model.safetensors")
    merged = load_file(final / "merged" / "model.safetensors")
    attention = [
        k for k in start if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
    ]
    changed = sorted(k for k in start if not torch.equal(merged[k], start[k]))
    assert changed == sorted(k for k in attention if k.startswith("language_model."))  # the rest as loaded
    # Each folder reloads its processor alone (they held the tokenizer only: AutoProcessor failed on them).
    processor = AutoProcessor.from_pretrained(final / "adapter")
    assert AutoProcessor.from_pretrained(final / "merged").to_dict() == processor.to_dict()
    assert processor.to_dict() == AutoProcessor.from_pretrained(root / "model").to_dict()
    base = AutoModelForImageTextToText.from_pretrained(root / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, final / "adapter").eval()
    hub = AutoModelForImageTextToText.from_pretrained(final / "merged", dtype=torch.float32).eval()
    assert type(hub) is Gemma3ForConditionalGeneration
    for model in (peft_model, hub):
        _assert_scores_as_the_last_evaluation(root, final, processor, model)
    card = (
        final / "README.md"
    ).read_text()  # its Use section names the classes that just reloaded the exports
    assert 'processor = AutoProcessor.from_pretrained("path/to/final/adapter")' in card
    assert "# LoRA adapters (rank 4, alpha 8) on q_proj, k_proj, v_proj, o_proj of the language model" in card
    assert (
        f'model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("{root / "model"}"), '
        '"path/to/final/adapter")'
    ) in card
    assert '# or, merged: AutoModelForImageTextToText.from_pretrained("path/to/final/merged")' in card
    assert "pipeline_tag: image-text-to-text" in card  # it said text-generation for a vision-language model


def test_evaluation_samples_log_their_images_to_tensorboard_and_wandb(runs: dict) -> None:
    """One text table and one image per sample at every evaluation (the reference's at step 0 too); each image is
    the pixels of its record's image file (32 to 48 px: below the 256 px bound); W&B's tables gain an image
    column."""
    from coati_kto.testing.tensorboard import read_images, read_samples

    root = runs["root"]
    assert runs["stdout"]["lora"].count(f"step 0: {SAMPLES} eval samples (policy and reference) in ") == 1
    records = {
        f"({100 + k})": json.loads(line)
        for k, line in enumerate((root / "eval.jsonl").read_text().splitlines())
    }
    samples, images = read_samples(root / "lora" / "tensorboard"), read_images(root / "lora" / "tensorboard")
    steps = {"policy": [0, 1, 2, 3], "reference": [0]}
    assert sorted(images) == [f"eval/samples/{who}/image/{k}" for who in steps for k in range(SAMPLES)]
    for who, want in steps.items():
        assert sorted(samples[who]) == want
        for step in want:
            assert [int(r["sample"]) for r in samples[who][step]] == list(range(SAMPLES))
            for row in samples[who][step]:
                record = next(r for key, r in records.items() if key in row["prompt"])
                pixels = np.asarray(Image.open(root / record["images"][0]).convert("RGB"))
                logged = dict(images[f"eval/samples/{who}/image/{row['sample']}"])[step]
                assert logged.shape == pixels.shape and np.array_equal(logged, pixels)
    tables = sorted((root / "lora" / "wandb").glob("offline-run-*/files/media/table/**/*.table.json"))
    assert len(tables) == 5, tables  # the policy's at steps 0-3, the reference's at step 0
    for path in tables:
        table = json.loads(path.read_text())
        assert table["columns"] == ["sample", "label", "reward", "prompt", "completion", "image"]
        assert [row[-1] for row in table["data"]] == ["Image"] * SAMPLES  # W&B's marker of an image cell


def test_a_resume_after_an_image_changed_in_place_is_refused(runs: dict) -> None:
    """The data file is unchanged, one of its images is not: the rows changed, so the resume is refused before
    the data is prepared again (the train_data digest holds the images' digests). Last: it edits the run's image,
    and puts it back."""
    root = runs["root"]
    image = root / "images" / "red-0.png"
    before = image.read_bytes()
    Image.new("RGB", (32, 32), (10, 10, 10)).save(image, "PNG")
    try:
        step1 = root / "one" / "checkpoints" / "step-1"
        proc = run_cli(["train", str(root / "one.yaml"), f"train.resume={step1}"], command=sgd_train)
    finally:
        image.write_bytes(before)
    assert proc.returncode == 2
    errors = [line for line in proc.ranks[0].stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: train.resume step-1: the training data changed since the checkpoint (the images: "
    ), proc.ranks[0].stderr[-2000:]


# family -> (the project-side processor class, prepare's image line for the train split: 32, 40 and 48 pixel wide
# images give 64, 60 and 60 soft tokens (Gemma 4), 4, 4 and 2 (Qwen 3.5)).
FAMILIES = {
    "gemma4_vl": ("Gemma4ImageProcessing", "    images per record: 16 with 1; image tokens 999 ("),
    "qwen3_5_vl": ("Qwen3VLImageProcessing", "    images per record: 16 with 1; image tokens 54 ("),
}


def _assert_cached_as_online(root: Path) -> None:
    """The cached reference's run against the online one: the losses within METRIC_BOUND; step 1's rewards and
    KL within 2e-6 of 0, not exactly 0 (the cache scores the rows in other batches: measured 4.8e-7 for Gemma 4,
    9.5e-7 for Qwen 3.5; docs/testing.md, what is exact)."""
    cached, online = logged_metrics(root / "cached"), logged_metrics(root / "one")
    step1 = [
        v
        for tag, values in cached.items()
        if tag.startswith(("train/rewards", "train/kl"))
        for s, v in values
        if s == 1
    ]
    assert step1 and max(abs(v) for v in step1) <= 2e-6, step1
    for tag in ("train/loss", "eval/loss"):
        assert [s for s, _ in cached[tag]] == [s for s, _ in online[tag]], tag
        for (_, got), (step, want) in zip(cached[tag], online[tag], strict=True):
            assert abs(got - want) <= METRIC_BOUND * abs(want), (tag, step, got, want)


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    roots = {}
    for family in FAMILIES:
        root = roots[family] = tmp_path_factory.mktemp(family)
        write_vl(root / "model", family)
        _records(root, 16, 0, "train.jsonl")
        _records(root, 4, 100, "eval.jsonl")
        _config(root, "one")
        _config(root, "resumed", resume=str(root / "one" / "checkpoints" / "step-1"))
        _config(root, "cached", kto={"reference": "cached"})
    proc = run_cli([str(r) for r in roots.values()], command=_lifecycle)
    assert proc.returncode == 0, proc.ranks[0].stderr[-3000:]
    return {"roots": roots, "stdout": proc.ranks[0].stdout}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_lifecycle_of_gemma4_and_qwen3_5_on_images(families: dict, family: str) -> None:
    """prepare counts the variable image tokens; step 1's rewards and KL are exactly 0; a resume from step 1 ends
    bit for bit; the cached reference (scored with the images) logs the online run's losses; final/ holds the
    checkpoint's processor files (the hub's class named) and scores the eval split through the project-side
    processor and AutoModelForImageTextToText as the run's last evaluation did."""
    from transformers import AutoModelForImageTextToText

    from coati_kto.data.processors import HUB_CLASS, load_processor_for_images

    root, stdout = families["roots"][family], families["stdout"]
    assert f"exit statuses {root.name} [0, 0, 0, 0]" in stdout
    assert FAMILIES[family][1] in stdout
    assert stdout.count(FALLBACK) == 4  # each family's two online runs (the cached one's note names both)
    assert_step1_rewards_and_kl_zero(root / "one")
    got, want = _weights(root / "resumed"), _weights(root / "one")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    _assert_cached_as_online(root)
    final = root / "one" / "final"
    processor_config = json.loads((final / "processor_config.json").read_text())
    assert processor_config["processor_class"] == HUB_CLASS[family[: -len("_vl")]]
    processor = load_processor_for_images(str(final))
    assert type(processor).__name__ == FAMILIES[family][0]
    card = (final / "README.md").read_text()
    assert (
        'load_processor_for_images("path/to/final")' in card
        and "AutoProcessor needs torchvision here" in card
    )
    model = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).eval()
    _assert_scores_as_the_last_evaluation(root, final, processor, model)
