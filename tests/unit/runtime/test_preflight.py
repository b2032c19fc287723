"""Preflight: mistakes that would surface only after the model loaded are one line before anything heavy."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import ConfigError
from coati_kto.runtime.preflight import _attention_problems, _lora_problems


def _model_dir(tmp_path: Path, config) -> Path:
    out = tmp_path / "model"
    config.save_pretrained(out)  # config.json only: preflight builds the model on the meta device
    return out


def _lora_config(tmp_path: Path, model_dir: Path, targets: str | None = None):
    text = MINIMAL.replace("path: some/model", f"path: {model_dir}\n  lora:\n    rank: 4")
    if targets:
        text = text.replace("rank: 4", f"rank: 4\n    target_modules: {targets}")
    return load_config(write_config(tmp_path, text))


def _attention(config) -> list[str]:
    return _attention_problems(config.model, config.plugin)


def _resume(config) -> list[str]:
    from coati_kto.runtime.resume_checks import resume_problems

    return resume_problems(config.train, config.output, config.model_dump(mode="json"))


def _resume_sections(config) -> tuple:
    """What resume_notice and announce_resume read: the train and output sections."""
    return config.train, config.output


def _intact_checkpoint(step: Path, world: int = 1) -> Path:
    """A complete checkpoint whose files a resume reads are all there (coati_kto.runtime.checkpoint_check): empty
    booster folders, torch files holding nothing of a run."""
    import json

    import torch

    for folder in ("trainer_state", "model", "optimizer"):
        (step / folder).mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": int(step.name[5:]), "world_size": world}))
    for rank in range(world):
        torch.save({"trainer_state": {}}, step / "trainer_state" / f"rank-{rank}.pt")
    torch.save({}, step / "lr_scheduler.pt")
    (step / "COMPLETE").write_text(f"step {step.name[5:]}\n")
    return step


def test_lora_targets_missing_from_the_model_are_named_with_its_linear_layers(tmp_path: Path) -> None:
    """GPT-2 has no q_proj: the default targets failed in peft after the model loaded (issue 17)."""
    from transformers import GPT2Config

    model_dir = _model_dir(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64))
    assert _lora_problems(_lora_config(tmp_path, model_dir).model) == [
        f"model.lora.target_modules: q_proj, k_proj, v_proj, o_proj match no module of GPT2LMHeadModel "
        f"({model_dir}); its linear layers: c_attn, c_fc, c_proj"
    ]
    assert _lora_problems(_lora_config(tmp_path, model_dir, "[c_attn, attn.c_proj]").model) == []


def test_lora_on_a_vision_language_model_adapts_its_language_model_only(tmp_path: Path) -> None:
    """q_proj also names the SigLIP tower's projections: adapters there would get no gradient (the tower is frozen
    and its features computed once without one). The default targets become a regex over the language model
    (all 8 of the tiny Gemma 3's adapters there, against 3 of 11 in the tower by suffix); a user's suffix that
    reaches the tower is refused in one line."""
    import peft

    from coati_kto.config.lora import peft_config
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    model = build_family_model("gemma3_vl", build_tokenizer(["a b c d"] * 5, vocab_size=280))
    model_dir = _model_dir(tmp_path, model.config)
    default = _lora_config(tmp_path, model_dir).model
    assert _lora_problems(default) == []
    config = peft_config(default.lora, model)
    assert config.target_modules == r".*model\.language_model\..*\.(q_proj|k_proj|v_proj|o_proj)"
    adapted = [n for n, m in peft.get_peft_model(model, config).named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 8 and all(".language_model.layers." in n for n in adapted), adapted
    suffixes = peft_config(_lora_config(tmp_path, model_dir, "[gate_proj, down_proj]").model.lora, model)
    assert sorted(suffixes.target_modules) == ["down_proj", "gate_proj"]  # in the language model only: kept
    assert _lora_problems(_lora_config(tmp_path, model_dir, "[gate_proj, down_proj]").model) == []
    assert _lora_problems(_lora_config(tmp_path, model_dir, "[q_proj, fc1, gate_proj]").model) == [
        "model.lora.target_modules: q_proj (model.vision_tower.encoder.layers.0.self_attn.q_proj), "
        "fc1 (model.vision_tower.encoder.layers.0.mlp.fc1) in the vision tower or projector of "
        "Gemma3ForConditionalGeneration, which stay frozen; name language-model modules only, or leave "
        "target_modules unset (its q_proj, k_proj, v_proj, o_proj in the language model)"
    ]


@pytest.mark.parametrize("family,adapters", [("gemma4_vl", 11), ("qwen3_5_vl", 4)])
def test_lora_default_targets_of_gemma4_and_qwen3_5_are_their_language_models(
    tmp_path: Path, family: str, adapters: int
) -> None:
    """Gemma 4's tower wraps its q_proj in Gemma4ClippableLinear, which peft refused by suffix."""
    import peft

    from coati_kto.config.lora import peft_config
    from coati_kto.testing.tiny import build_family_model, build_tokenizer

    model = build_family_model(family, build_tokenizer(["a b c d"] * 5, vocab_size=280))
    model_dir = _model_dir(tmp_path, model.config)
    default = _lora_config(tmp_path, model_dir).model
    assert _lora_problems(default) == []
    adapted = [
        n
        for n, m in peft.get_peft_model(model, peft_config(default.lora, model)).named_modules()
        if hasattr(m, "lora_A")
    ]
    assert len(adapted) == adapters and all(".language_model.layers." in n for n in adapted), adapted
    if family == "gemma4_vl":  # the suffixes alone: peft's refusal
        fresh = build_family_model(family, build_tokenizer(["a b c d"] * 5, vocab_size=280))
        with pytest.raises(ValueError, match="Target module Gemma4ClippableLinear"):
            peft.get_peft_model(fresh, peft.LoraConfig(target_modules=list(default.lora.target_modules)))


@pytest.mark.parametrize("targets", [None, "[q_proj, gate_proj, down_proj]"])
def test_lora_targets_of_a_llama_pass(tmp_path: Path, targets: str | None) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    assert _lora_problems(_lora_config(tmp_path, _model_dir(tmp_path, config), targets).model) == []


def test_flex_attention_is_refused_for_training_on_cpu(tmp_path: Path) -> None:
    """torch has no FlexAttention backward on CPU: the first gradient pass raised NotImplementedError."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU trains with flex_attention")
    path = write_config(tmp_path, MINIMAL)
    (line,) = _attention(load_config(path, ["model.attn_implementation=flex_attention"]))
    assert line.startswith("model.attn_implementation flex_attention: torch ") and "use sdpa" in line
    assert _attention(load_config(path, ["model.attn_implementation=sdpa"])) == []


def test_fp16_is_refused_for_training_on_cpu(tmp_path: Path) -> None:
    """fp16 passed every check on CPU, then ColossalAI's loss scaler raised "this method is not supported for cpu
    accelerator" (device_count) in a traceback per rank, after the models had loaded."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU trains in fp16")
    path = write_config(tmp_path, MINIMAL)
    for plugin in (["plugin.name=hybrid_parallel"], ["plugin.name=low_level_zero", "plugin.zero_stage=2"]):
        assert _attention(load_config(path, [*plugin, "plugin.precision=fp16"])) == [
            "plugin.precision fp16 needs a GPU (ColossalAI's loss scaler); use bf16 or fp32 on CPU"
        ]
    assert _attention(load_config(path, ["plugin.precision=bf16"])) == []


def test_flash_attention_without_flash_attn_is_refused_before_prepare(tmp_path: Path) -> None:
    """node_8gpu_zero2.yaml and multinode_zero2.yaml name flash_attention_2: without the optional flash-attn the
    refusal came at model load, after prepare had tokenized the whole data set."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed")
    path = write_config(tmp_path, MINIMAL)
    assert _attention(load_config(path, ["model.attn_implementation=flash_attention_2"])) == [
        "model.attn_implementation flash_attention_2 needs the flash-attn package, which is not installed: "
        "pip install flash-attn --no-build-isolation, or set model.attn_implementation=sdpa"
    ]


def test_resume_auto_over_a_run_without_checkpoints_says_what_to_do(tmp_path: Path) -> None:
    """A run killed before its first checkpoint left events only: train.resume=auto was refused with 'continue it
    with train.resume=auto', the setting the user had just given."""
    from coati_kto.runtime.preflight import _output_problems

    out = tmp_path / "out"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"")
    text = MINIMAL.replace("dir: out", f"dir: {out}")
    fresh = load_config(write_config(tmp_path, text))
    assert _output_problems(fresh.train, fresh.output) == [
        f"output.dir: {out} already holds a run (tensorboard/ events): continue it with train.resume=auto, or "
        "start over with output.overwrite=true (deletes its checkpoints, events, final model and exports)"
    ]
    auto = load_config(write_config(tmp_path, text + "train:\n  resume: auto\n"))
    assert _output_problems(auto.train, auto.output) == [
        f"output.dir: {out} holds a run (tensorboard/ events) with no complete checkpoint, so train.resume=auto "
        "has nothing to continue: start over with output.overwrite=true (deletes its events and final model), or "
        "use another output.dir"
    ]


def test_a_hub_id_is_looked_up_on_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id not yet in the local cache: one HEAD request decides. huggingface_hub 1.x's session is an httpx
    Client, which has no ``allow_redirects``: every such id was refused as "the hub cannot be reached (TypeError)",
    on machines that reach the hub too (every GPU config names a hub id)."""
    from huggingface_hub import constants

    from coati_kto.runtime.preflight import _hub_problems
    from coati_kto.testing.hub import StandInHub

    with StandInHub(token="hf_standin") as hub:
        hub.commit("model", "org/public", {"config.json": b"{}"}, cdn=True)  # resolves through a 302
        hub.commit("model", "org/gated", {"config.json": b"{}"}, gated=True)
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", "/nonexistent/token")
        assert _hub_problems("model.path", "org/public") == []  # found (through a redirect)
        assert _hub_problems("model.path", "org/gated") == [
            "model.path: org/gated on the hub needs a token (gated or private): see docs/operations.md, Credentials"
        ]
        # Without a token a mistyped id answers 401 RepoNotFound, as a private repo does: it was "needs a token".
        assert _hub_problems("model.path", "org/mistyped") == [
            "model.path: org/mistyped is neither a local directory nor a public model on the hub (check the id; a "
            "private repo needs a token: see docs/operations.md, Credentials)"
        ]
        monkeypatch.setenv("HF_TOKEN", "hf_standin")  # with a token, the Hub says 404 for a missing repo
        assert _hub_problems("model.path", "org/missing") == [
            "model.path: org/missing is neither a local directory nor a model on the hub"
        ]
        assert (
            "HEAD",
            "/cdn/model/org/public/" + hub.repos[("model", "org/public")].branches["main"] + "/config.json",
        ) in hub.requests
        assert hub.unhandled == []


def test_a_mistyped_local_model_path_is_named_beside_the_hub_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`model.path: outputs/tiny-chatt` (a typo of a folder beside it) reads as a Hub id: the line said only that
    the Hub could not be reached or was offline, and advised a download."""
    from coati_kto.runtime.preflight import _hub_problems

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "tiny-chat").mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert _hub_problems("model.path", "outputs/tiny-chatt") == [
        "model.path: outputs/tiny-chatt is not a local directory and not in the hub cache, and HF_HUB_OFFLINE is "
        "set; outputs/ is a local folder without tiny-chatt (did you mean outputs/tiny-chat?)"
    ]
    assert _hub_problems("model.path", "outputs/other")[0].endswith(
        "; outputs/ is a local folder without other"
    )
    assert _hub_problems("model.path", "org/other")[0].endswith("HF_HUB_OFFLINE is set")  # no folder org/


def test_a_refused_resume_is_said_before_the_data_is_prepared(tmp_path: Path) -> None:
    """train.resume with a config the checkpoint refuses (here data.max_length) was refused only once the run
    had set up: data.prepared_dir rebuilt for the new config (its reference cache deleted) and the new data
    scored with the reference, all of which a resume unchanged then had to do again."""
    import torch

    out = tmp_path / "out"
    text = MINIMAL.replace("dir: out", f"dir: {out}").replace(
        "prepared_dir: prepared", "prepared_dir: p\n  max_length: 48\n  max_prompt_length: 16"
    )
    saved = load_config(write_config(tmp_path, text)).model_dump(mode="json")
    step = _intact_checkpoint(out / "checkpoints" / "step-4")
    torch.save({"trainer_state": {"config": saved}, "rng": None}, step / "trainer_state" / "rank-0.pt")
    unchanged = load_config(write_config(tmp_path, text), ["train.resume=auto", "train.max_steps=6"])
    assert _resume(unchanged) == []
    changed = load_config(write_config(tmp_path, text), ["train.resume=auto", "data.max_length=40"])
    assert _resume(changed) == [
        "train.resume step-4: data.max_length 48 -> 40: cannot change on resume (the data position of the epoch "
        "in progress belongs to the old training set)",
        "(start a new run in another output.dir, or resume unchanged)",
    ]
    assert _resume(load_config(write_config(tmp_path, text), [f"train.resume={step}", "data.max_length=40"]))
    overwrite = [
        "train.resume=auto",
        "output.overwrite=true",
        "data.max_length=40",
    ]  # a new run: deletes step-4
    assert _resume(load_config(write_config(tmp_path, text), overwrite)) == []
    assert not (tmp_path / "p").exists()


def _qwen3_moe_dir(tmp_path: Path) -> Path:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return _model_dir(tmp_path, config)


@pytest.mark.parametrize("targets", ["[gate_proj, up_proj, down_proj]", "[q_proj, gate]"])
def test_lora_targets_peft_maps_onto_fused_moe_experts_pass(tmp_path: Path, targets: str) -> None:
    """transformers 5 fuses an MoE's experts into 3D parameters and makes the router a custom module: peft maps
    the v4 names (gate_proj, up_proj, down_proj; gate) onto them (target_parameters), so preflight must too."""
    assert _lora_problems(_lora_config(tmp_path, _qwen3_moe_dir(tmp_path), targets).model) == []


@pytest.mark.parametrize(
    "targets,kind", [("[experts]", "Qwen3MoeExperts"), ("[q_proj, mlp]", "Qwen3MoeSparseMoeBlock")]
)
def test_lora_targets_peft_cannot_adapt_are_named(tmp_path: Path, targets: str, kind: str) -> None:
    """A name that exists but is no layer peft wraps failed in peft after every rank loaded the model."""
    model_dir = _qwen3_moe_dir(tmp_path)
    assert _lora_problems(_lora_config(tmp_path, model_dir, targets).model) == [
        f"model.lora.target_modules: peft cannot put adapters on {kind} (not a linear layer) of "
        f"Qwen3MoeForCausalLM ({model_dir}); its linear layers: k_proj, o_proj, q_proj, v_proj"
    ]


def test_lora_dropout_on_moe_parameters_is_named_before_loading(tmp_path: Path) -> None:
    """peft's ParamWrapper (the experts' and router's fused parameters) refuses lora_dropout != 0."""
    model_dir = _qwen3_moe_dir(tmp_path)
    config = _lora_config(tmp_path, model_dir, "[q_proj, gate]\n    dropout: 0.1")
    assert _lora_problems(config.model) == [
        f"model.lora: peft refuses it for Qwen3MoeForCausalLM ({model_dir}): lora.ParamWrapper does not work "
        "with lora_dropout != 0."
    ]


def test_a_push_that_cannot_succeed_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """output.push_to_hub without a token would fail only after the whole run: said before it (by global rank 0
    and the launcher: the other ranks upload nothing, and multi-node launchers strip *TOKEN* variables)."""
    from coati_kto.runtime.preflight import push_problems

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(
        constants, "HF_TOKEN_PATH", str(tmp_path / "no-token")
    )  # read at import, not per call
    config = load_config(write_config(tmp_path, MINIMAL + "  push_to_hub: me/kto\n"))
    no_token = (
        "output.push_to_hub me/kto: no Hugging Face token (set HF_TOKEN, or run `hf auth login`): the upload at "
        "the end of the run would fail"
    )
    assert push_problems(config.output) == [no_token]
    monkeypatch.setenv("RANK", "1")
    assert push_problems(config.output) == []
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "no-token").write_text("hf_from_the_token_file\n")  # what `hf auth login` writes
    assert push_problems(config.output) == []
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert push_problems(config.output) == [
        "output.push_to_hub me/kto: HF_HUB_OFFLINE is set, so nothing can be uploaded"
    ]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")  # huggingface_hub reads it too; it said HF_HUB_OFFLINE
    assert push_problems(config.output) == [
        "output.push_to_hub me/kto: TRANSFORMERS_OFFLINE is set, so nothing can be uploaded"
    ]
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    unsaved = load_config(write_config(tmp_path, MINIMAL + "  push_to_hub: me/kto\n  save_final: false\n"))
    assert push_problems(unsaved.output) == [
        "output.push_to_hub me/kto with output.save_final false: there is no final/ to upload"
    ]
    assert push_problems(load_config(write_config(tmp_path, MINIMAL)).output, exporting=True) == [
        "coati-kto export --push needs output.push_to_hub (the repo id)"
    ]


def test_a_run_that_resumes_says_so_once_and_how_to_start_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rerun of a config with train.resume=auto continued the old run in silence (TRL starts anew unless told to
    resume). The line is said once per launch: by the --nproc-per-node launcher (its workers then stay quiet), else
    by global rank 0; never by the other ranks, never for a run that starts from step 0."""
    from coati_kto.runtime.preflight import RESUME_SAID_ENV, announce_resume, resume_notice

    monkeypatch.setenv(RESUME_SAID_ENV, "")  # unset (and restored after the launcher sets it)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    path = write_config(tmp_path, MINIMAL.replace("dir: out", f"dir: {out}"))
    auto = load_config(path, ["train.resume=auto"])
    assert resume_notice(*_resume_sections(auto)) is None  # no checkpoint yet: a new run
    step = _intact_checkpoint(out / "checkpoints" / "step-4")
    said = (
        f"resuming the run in {out} from step-4 (train.resume=auto); to start over instead, add "
        "output.overwrite=true (deletes its checkpoints, events, final model and exports) or choose another output.dir"
    )
    assert resume_notice(*_resume_sections(auto)) == said
    assert resume_notice(*_resume_sections(load_config(path, [f"train.resume={step}"]))) == (
        f"resuming from {step} (train.resume); to start over instead, leave train.resume unset"
    )
    # auto with output.overwrite starts over: said, since the run it would have continued is deleted
    assert resume_notice(
        *_resume_sections(load_config(path, ["train.resume=auto", "output.overwrite=true"]))
    ) == (
        f"starting over in {out}: output.overwrite=true deletes its run (checkpoints/step-4) instead of "
        "continuing it (train.resume=auto); to continue it, drop output.overwrite"
    )
    assert resume_notice(*_resume_sections(load_config(path))) is None
    monkeypatch.setenv("RANK", "1")
    announce_resume(*_resume_sections(auto))
    monkeypatch.setenv("RANK", "0")
    announce_resume(*_resume_sections(auto))
    assert capsys.readouterr().out == said + "\n"
    monkeypatch.delenv("RANK")
    # the launcher says it; its workers (RANK 0 included) do not again
    announce_resume(*_resume_sections(auto), launcher=True)
    monkeypatch.setenv("RANK", "0")
    announce_resume(*_resume_sections(auto))
    assert capsys.readouterr().out == said + "\n"


@pytest.mark.parametrize(("local_rank", "quiet"), [("0", False), ("3", True)])
def test_each_nodes_first_rank_says_its_own_preflight_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_rank: str, quiet: bool
) -> None:
    """What the checks read can differ between nodes (model.path on node-local disk): a ConfigError from them is
    printed by the first rank of each node (``same_on_every_rank`` False there), not by global rank 0 alone. It
    was marked the same on every rank for the whole class, so a node whose copy was missing exited 2 in silence
    while rank 0 waited for it in the process group's rendezvous."""
    from coati_kto.errors import ConfigError
    from coati_kto.recipe.train import train

    config = load_config(write_config(tmp_path, MINIMAL.replace("some/model", str(tmp_path / "missing"))))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(ConfigError, match="model.path") as raised:
        train(config)
    assert raised.value.same_on_every_rank is quiet


def test_prepare_names_every_missing_path_at_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`coati-kto prepare` (and inspect) stopped at a missing model.path; the data file missing beside it came
    only after that was fixed (train listed both)."""
    from coati_kto.cli import main

    config = write_config(
        tmp_path,
        "model:\n  path: ./no-model\ndata:\n  train_files: [./no-data.jsonl]\n  eval_files: [./no-eval.jsonl]\n"
        f"  prepared_dir: {tmp_path / 'prepared'}\n",
    )
    for command in ("prepare", "inspect"):
        assert main([command, str(config)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            "error: model.path: ./no-model does not exist (a local path, read from "
            f"{Path.cwd()}; a hub id looks like org/name)",
            f"data.train_files: ./no-data.jsonl: no such file or directory (read from {Path.cwd()})",
            f"data.eval_files: ./no-eval.jsonl: no such file or directory (read from {Path.cwd()})",
        ]
    assert not (tmp_path / "prepared").exists()


def test_overwrite_with_a_resume_path_inside_output_dir_is_refused_before_anything_is_deleted(
    tmp_path: Path,
) -> None:
    """output.overwrite=true deleted checkpoints/ and final/, then train.resume's checkpoint there "did not
    exist" (exit 2, the run gone). The pair is refused in one line by the preflight (and by setup_training before
    it would clear: coati_kto.runtime.resume_checks.overwrite_refusal); a checkpoint elsewhere is fine."""
    from coati_kto.runtime.preflight import check_training
    from coati_kto.runtime.resume_checks import overwrite_refusal

    out = tmp_path / "out"
    step = _intact_checkpoint(out / "checkpoints" / "step-20")
    text = MINIMAL.replace("dir: out", f"dir: {out}")
    both = load_config(write_config(tmp_path, text), [f"train.resume={step}", "output.overwrite=true"])
    said = (
        f"train.resume {step} is inside output.dir {out}, which output.overwrite=true deletes before the resume "
        "reads it: drop output.overwrite to continue from it, or copy the checkpoint out of output.dir first"
    )
    assert _resume(both) == [said]
    with pytest.raises(ConfigError) as err:
        check_training(both)
    assert said in str(err.value).splitlines()
    assert (step / "COMPLETE").is_file()
    elsewhere = _intact_checkpoint(tmp_path / "other" / "step-20")
    other = load_config(write_config(tmp_path, text), [f"train.resume={elsewhere}", "output.overwrite=true"])
    assert overwrite_refusal(other.train, other.output) is None
    auto = load_config(write_config(tmp_path, text), ["train.resume=auto", "output.overwrite=true"])
    assert overwrite_refusal(auto.train, auto.output) is None and _resume(auto) == []


def test_a_quantized_model_is_refused_at_config_load_and_at_load(tmp_path: Path) -> None:
    """From an audit: a config.json with a quantization_config was never refused. bitsandbytes' 4-bit layers failed
    the first step with an AssertionError traceback, GPTQ and AWQ with an ImportError after prepare, and fp8 was
    dequantized on the CPU and trained and exported as full precision without a word."""
    import json

    import torch
    from transformers import LlamaConfig

    from coati_kto.models.hf import load_causal_lm

    model_dir = _model_dir(
        tmp_path,
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4),
    )
    raw = json.loads((model_dir / "config.json").read_text())
    for method in ("bitsandbytes", "gptq", "awq", "fp8"):
        (model_dir / "config.json").write_text(
            json.dumps({**raw, "quantization_config": {"quant_method": method}})
        )
        with pytest.raises(ConfigError) as err:
            load_config(write_config(tmp_path, MINIMAL.replace("path: some/model", f"path: {model_dir}")))
        assert (
            f"model.path {model_dir}: its weights are quantized ({method}, config.json's quantization_config)"
            in (str(err.value))
        )
        config = load_config(write_config(tmp_path, MINIMAL))  # a Hub id: refused where its config is read
        with pytest.raises(ConfigError, match=rf"^{model_dir}: its weights are quantized \({method}"):
            load_causal_lm(str(model_dir), config.model, torch.float32)


def test_a_sharded_model_missing_a_shard_is_one_line_before_prepare(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """From an audit: the index's shards were not checked, and a folder a download left short failed at model
    load with a FileNotFoundError traceback, after the data was prepared."""
    import json
    import shutil

    from coati_kto.runtime.preflight import _directory_problems

    model_dir = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, model_dir)
    weights = {"model.embed_tokens.weight": "model-00001-of-00003.safetensors"}
    weights |= {
        "model.norm.weight": "model-00002-of-00003.safetensors",
        "lm_head.weight": "model-00003-of-00003.safetensors",
    }
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00003.safetensors")
    index = model_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    assert _directory_problems("model.path", model_dir, False, True) == [
        f"model.path: {model_dir} lacks 2 of the 3 weight files its model.safetensors.index.json names "
        "(model-00002-of-00003.safetensors, model-00003-of-00003.safetensors): a download cut short? (hf download "
        "fetches what is missing)"
    ]
    index.write_text("[]")
    assert _directory_problems("model.path", model_dir, False, True) == [
        f"model.path: {index} is no readable weight index (a JSON object with a weight_map)"
    ]
    # A whole model.safetensors beside a stale index: transformers loads the file, not the index
    (model_dir / "model-00001-of-00003.safetensors").rename(model_dir / "model.safetensors")
    assert _directory_problems("model.path", model_dir, False, True) == []
