"""TRL's flags and a TRL-style flat YAML translated to this project's keys: every flag accounted for in the one
line (its override, or why it has none), local dataset paths, TRL's precision and LoRA defaults, and the field
errors a TRL value gets (train.resume=true, train.max_steps=-1, train.micro_batch_size=1) saying what to write."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.cli_args import _parser
from coati_kto.cli_args import parse as _parse
from coati_kto.config.load import load_config
from coati_kto.config.trl_argv import BARE_OPTIONS
from coati_kto.config.trl_flags import COMMAND_OPTIONS, CONFIG_COMMANDS, trl_hint
from coati_kto.errors import ConfigError
from coati_kto.trainer.schedule import planned_steps

TAIL = " (coati-kto config --schema lists every key)"


def _line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    return line


def _parts(line: str) -> list[str]:
    """The ``--flag ... is ...`` parts of the line, without its head and the command at its end."""
    body = line.split(" are not options of coati-kto ", 1)[1].split(": ", 1)[1]
    body = body.split("; as overrides after the config")[0].split("; none of them has an override")[0]
    return body.split("; --")[:1] + ["--" + part for part in body.split("; --")[1:]]


def _suggested(line: str) -> argparse.Namespace:
    """The line's command as coati-kto parses it (its own options, then the overrides)."""
    command = line.split("as overrides after the config: ")[1].removesuffix(TAIL)
    assert shlex.split(command)[0] == "coati-kto"
    return _parse(shlex.split(command)[1:])


def _loaded(line: str, path: Path) -> object:
    """The config the line's command loads (its overrides after ``coati-kto CMD CONFIG``)."""
    return load_config(path, _suggested(line).overrides)


def _errors(path: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value).splitlines()


@pytest.mark.parametrize("value", ["./data/saved", "data/std.jsonl", "/abs/dir", "a/b/c", "saved"])
def test_a_local_dataset_name_is_a_path_not_a_hub_dataset(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dataset_name ./data/saved` became data.train_files=hf://datasets/./data/saved, then refused."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved").mkdir()  # a bare name that exists here is read from disk, as load_dataset would
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--dataset_name", value, "--dataset_config", "en"], capsys)
    assert _parts(line) == [
        f"--dataset_name {value} is data.train_files=[{value}] (a local path)",
        "--dataset_config en has no equivalent for a local --dataset_name (hf://datasets entries only)",
    ]
    assert _loaded(line, path).data.train_files == [value]
    hub = _line(["train", "--dataset_name", "trl-lib/kto", "--dataset_config", "en"], capsys)
    assert "data.train_files=hf://datasets/trl-lib/kto?config=en" in hub
    assert "--dataset_config en is config=en in data.train_files" in hub


def test_every_flag_is_accounted_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Unmapped flags vanished from the line when others mapped (--warmup_ratio, --report_to, ...)."""
    path = write_config(tmp_path, MINIMAL)
    argv = ["train", str(path), "--beta", "0.1", "--lr_scheduler_type=cosine", "--warmup_ratio", "0.1"]
    line = _line([*argv, "--report_to", "wandb", "--logging_first_step"], capsys)
    schedule = (
        "the schedule here: linear warmup over train.warmup_steps, then train.lr_schedule (cosine or linear) to "
        "lr x train.min_lr_ratio"
    )
    assert line == (
        "error: TRL-style flags are not options of coati-kto train: --beta 0.1 is kto.beta=0.1; "
        f"--lr_scheduler_type cosine is train.lr_schedule=cosine train.min_lr_ratio=0.0 ({schedule}); "
        "--warmup_ratio 0.1 has no "
        "equivalent (no ratio here; set train.warmup_steps to 10% of the run's steps); --report_to wandb is "
        "logging.wandb=true (TensorBoard stays on unless logging.tensorboard=false); --logging_first_step has "
        "no equivalent (train/ metrics every train.log_interval steps); as overrides after the config: "
        f"coati-kto train {path} kto.beta=0.1 train.lr_schedule=cosine train.min_lr_ratio=0.0 logging.wandb=true"
        + TAIL
    )
    flags = ["--save_total_limit", "3", "--dataset_num_proc", "4", "--precompute_ref_log_probs"]
    flags += ["--report_to", "none", "--max_steps", "-1", "--resume_from_checkpoint", "True"]
    flags += ["--max_completion_length", "256", "--lr_scheduler_type", "linear", "--bogus", "1"]
    line = _line(["train", str(path), *flags, "--nproc_per_node", "8", "--nproc-per-node", "8"], capsys)
    assert _parts(line)[4:] == [
        "--max_steps -1 is train.max_steps=null (transformers' -1: no limit)",
        "--resume_from_checkpoint True is train.resume=auto (the newest checkpoint in output.dir)",
        "--max_completion_length 256 has no equivalent (no such key: a completion keeps what data.max_length "
        "leaves after its prompt)",
        f"--lr_scheduler_type linear is train.lr_schedule=linear train.min_lr_ratio=0.0 ({schedule})",
        "--bogus 1 has no equivalent (not a TRL flag known here)",
        "--nproc_per_node 8 has no equivalent (coati-kto's option is --nproc-per-node)",
    ]
    config = _loaded(line, path)
    assert (config.output.keep_last, config.data.num_proc, config.kto.reference) == (3, 4, "cached")
    assert (config.logging.wandb, config.logging.tensorboard) == (False, False)
    assert (config.train.max_steps, config.train.resume) == (None, "auto")
    assert (config.train.lr_schedule, config.train.min_lr_ratio) == ("linear", 0.0)  # TRL's default schedule
    # A line of unmapped flags only is still one line, not argparse's "unrecognized arguments".
    assert _line(["train", str(path), "--logging_first_step"], capsys).endswith(
        "--logging_first_step has no equivalent (train/ metrics every train.log_interval steps); none of them "
        "has an override here" + TAIL
    )


def test_the_command_options_are_the_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag that is the command's own option is not TRL's: the set must follow coati_kto/cli.py."""
    subparsers = next(a for a in _parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    options = {
        o.removeprefix("--")
        for name in CONFIG_COMMANDS
        for a in subparsers.choices[name]._actions
        for o in a.option_strings
        if o.startswith("--")
    }
    assert options == COMMAND_OPTIONS
    bare = {
        o.removeprefix("--")
        for name in CONFIG_COMMANDS
        for a in subparsers.choices[name]._actions
        for o in a.option_strings
        if o.startswith("--") and a.nargs == 0
    }
    assert bare == BARE_OPTIONS  # the options that take no value: the next token is not theirs
    line = _line(["inspect", "cfg.yaml", "--ranks", "2", "--beta", "0.2"], capsys)
    assert _parts(line) == ["--beta 0.2 is kto.beta=0.2"]


@pytest.mark.parametrize(
    ("flags", "precision"),
    [
        (["--fp16", "False"], "bf16"),  # TRL: an unset bf16 is `not fp16`
        (["--fp16", "False", "--bf16", "False"], "fp32"),
        (["--bf16", "False"], "fp32"),
        (["--bf16", "True", "--fp16", "False"], "bf16"),
        (["--fp16"], "fp16"),
    ],
)
def test_precision_flags_resolve_as_trl_does(
    flags: list[str], precision: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--fp16 False` was always plugin.precision=bf16, even beside `--bf16 False` (TRL: fp32)."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), *flags], capsys)
    assert all(f" is plugin.precision={precision}" in part for part in _parts(line))
    config = _loaded(line, path)
    assert config.plugin.precision == precision
    assert config.output.export_dtype == ("training" if precision == "fp32" else "fp32")
    if flags == ["--fp16", "False"]:
        assert (
            "(TRL trains bf16 when fp16 is off; fp32: --bf16 False; fp32 final/ weights, as TRL saves)"
            in line
        )


def test_bf16_exports_fp32_weights_where_admitted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TRL saves fp32 weights after bf16 training; here final/ was bf16 unless output.export_dtype=fp32."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--bf16"], capsys)
    assert _parts(line) == [
        "--bf16 is plugin.precision=bf16 output.export_dtype=fp32 (fp32 final/ weights, as TRL saves)"
    ]
    assert _loaded(line, path).output.export_dtype == "fp32"
    refused = (
        "(final/ stays bf16: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false)"
    )
    (tmp_path / "lora").mkdir()
    lora = write_config(tmp_path / "lora", MINIMAL.replace("some/model\n", "some/model\n  lora: {rank: 4}\n"))
    for argv in (
        ["train", str(path), "--bf16", "--use_peft"],
        ["train", str(path), "--bf16", "plugin.tp_size=2"],
        ["train", str(path), "--bf16", "model.lora.rank=4"],
        ["train", str(path), "--bf16", "output.save_final=false"],  # an fp32 export of nothing is refused
    ):
        assert f"--bf16 is plugin.precision=bf16 {refused}" in _line(argv, capsys)
    assert "output.export_dtype" not in _line(["train", str(lora), "--bf16"], capsys)


def test_use_peft_gets_trls_lora_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--use_peft` was model.lora={rank: 8}; TRL's ModelConfig has r 16, alpha 32, dropout 0.05."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--use_peft"], capsys)
    assert "--use_peft is model.lora={rank: 16, alpha: 32, dropout: 0.05} (TRL's LoRA defaults)" in line
    lora = _loaded(line, path).model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.05)
    # --lora_r before --use_peft: the mapping goes first, so the rank given is kept.
    line = _line(["train", str(path), "--lora_r", "32", "--use_peft"], capsys)
    assert _loaded(line, path).model.lora.rank == 32


def test_lora_flags_without_use_peft_say_they_turn_lora_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """TRL ignores --lora_r without --use_peft (full fine-tuning); here it turns LoRA on, which was not said."""
    path = write_config(tmp_path, MINIMAL)
    note = " (TRL ignores it without --use_peft and trains every weight; here it turns LoRA on)"
    line = _line(["train", str(path), "--lora_r", "8", "--lora_dropout", "0.1"], capsys)
    assert _parts(line) == [
        f"--lora_r 8 is model.lora.rank=8{note}",
        f"--lora_dropout 0.1 is model.lora.dropout=0.1{note}",
    ]
    assert _loaded(line, path).model.lora.rank == 8
    assert note not in _line(["train", str(path), "--lora_r", "8", "--use_peft"], capsys)
    assert note in _line(["train", str(path), "--lora_r", "8", "--use_peft", "false"], capsys)


@pytest.mark.parametrize(("value", "samples"), [([], 8), (["True"], 8), (["false"], 0)])
def test_generate_during_eval_is_a_switch(
    value: list[str], samples: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--generate_during_eval True` became eval.samples=True, refused (and bare: eval.samples=VALUE)."""
    path = write_config(tmp_path, MINIMAL.replace("  prepared_dir", "  eval_fraction: 0.2\n  prepared_dir"))
    line = _line(["train", str(path), "--generate_during_eval", *value], capsys)
    note = " (8 prompts decoded at each evaluation)" if samples else ""
    assert _parts(line) == [
        f"--generate_during_eval{''.join(' ' + v for v in value)} is eval.samples={samples}{note}"
    ]
    assert _loaded(line, path).eval.samples == samples


def test_a_trl_style_flat_yaml_gets_a_hint_for_every_trl_key(tmp_path: Path) -> None:
    """Only learning_rate and the like got "did you mean"; bf16, warmup_ratio, ... got a bare "unknown key"."""
    text = "model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/kto-mix-14k\nbf16: true\n"
    text += "warmup_ratio: 0.1\nlr_scheduler_type: linear\nlearning_rate: 1.0e-6\nreport_to: [wandb]\n"
    text += "generate_during_eval: true\nmax_completion_length: 256\nuse_peft: true\n"
    path = write_config(tmp_path, MINIMAL + text)
    lines = [line.split(": ", 1)[1] for line in _errors(path, [])]
    schedule = (
        "the schedule here: linear warmup over train.warmup_steps, then train.lr_schedule (cosine or linear) to "
        "lr x train.min_lr_ratio"
    )
    assert lines == [
        "model_name_or_path: unknown key (did you mean model.path?)",
        "dataset_name: unknown key; TRL's dataset_name trl-lib/kto-mix-14k is "
        "data.train_files=hf://datasets/trl-lib/kto-mix-14k",
        # read beside use_peft: true (the file's other keys): an fp32 export is refused with LoRA
        "bf16: unknown key; TRL's bf16 true is plugin.precision=bf16 (final/ stays bf16: an fp32 export is refused "
        "with LoRA, tp_size > 1 or output.save_final false)",
        "warmup_ratio: unknown key; TRL's warmup_ratio 0.1 has no equivalent (no ratio here; set "
        "train.warmup_steps to 10% of the run's steps)",
        "lr_scheduler_type: unknown key; TRL's lr_scheduler_type linear is train.lr_schedule=linear "
        f"train.min_lr_ratio=0.0 ({schedule})",
        "learning_rate: unknown key (did you mean train.lr?)",
        "report_to: unknown key; TRL's report_to wandb is logging.wandb=true (TensorBoard stays on unless "
        "logging.tensorboard=false)",
        "generate_during_eval: unknown key; TRL's generate_during_eval true is eval.samples=8 (8 prompts decoded "
        "at each evaluation)",
        "max_completion_length: unknown key; TRL's max_completion_length 256 has no equivalent (no such key: a "
        "completion keeps what data.max_length leaves after its prompt)",
        "use_peft: unknown key; TRL's use_peft true is model.lora={rank: 16, alpha: 32, dropout: 0.05} (TRL's "
        "LoRA defaults)",
    ]


def test_trl_values_get_what_to_write_instead(tmp_path: Path) -> None:
    """train.resume=true, train.max_steps=-1 and train.micro_batch_size=1 got pydantic's bare message."""
    path = write_config(tmp_path, MINIMAL)
    assert _errors(path, ["train.resume=true", "train.max_steps=-1", "train.micro_batch_size=1"]) == [
        "override train.micro_batch_size=1: Input should be greater than or equal to 2 (got 1); each micro-batch "
        "must hold both labels (a desirable and an undesirable example); for the same examples per step set 2 "
        "and halve train.accumulation_steps",
        "override train.max_steps=-1: Input should be greater than or equal to 1 (got -1); null (or leave it out) "
        "for no limit",
        "override train.resume=true: Input should be a valid string (got True); use auto (the newest checkpoint) "
        "or a checkpoint path",
    ]


def test_a_list_valued_flag_keeps_every_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--report_to wandb tensorboard` and `--lora_target_modules q_proj v_proj` (HfArgumentParser's nargs="+")
    were read for their first value: tensorboard and v_proj vanished from the line and its overrides."""
    path = write_config(tmp_path, MINIMAL)
    argv = [
        "train",
        str(path),
        "--report_to",
        "wandb",
        "tensorboard",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
    ]
    line = _line([*argv, "--lora_modules_to_save", "lm_head", "embed_tokens", "kto.beta=0.2"], capsys)
    assert _parts(line) == [
        "--report_to wandb tensorboard is logging.wandb=true logging.tensorboard=true",
        "--lora_target_modules q_proj v_proj is model.lora.target_modules=[q_proj,v_proj]",
        "--lora_modules_to_save lm_head embed_tokens has no equivalent (adapters only: model.lora.target_modules)",
    ]
    config = _loaded(line, path)
    assert (config.logging.wandb, config.logging.tensorboard) == (True, True)
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    # comma-separated as one value, and the values stop at the config file
    line = _line(["train", "--lora_target_modules=q_proj,k_proj", "o_proj", str(path)], capsys)
    assert _parts(line) == [
        "--lora_target_modules q_proj,k_proj o_proj is model.lora.target_modules=[q_proj,k_proj,o_proj]"
    ]
    assert _loaded(line, path).model.lora.target_modules == ["q_proj", "k_proj", "o_proj"]
    assert _parts(_line(["train", str(path), "--lora_target_modules", "all-linear"], capsys)) == [
        "--lora_target_modules all-linear has no equivalent (name the layers: model.lora.target_modules=[q_proj,"
        "k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj] on Llama-style models)"
    ]
    # TRL's newer ModelConfig / ScriptArguments flags were "not a TRL flag known here"
    line = _line(
        ["train", str(path), "--lora_target_parameters", "a.w", "b.w", "--dataset_streaming"], capsys
    )
    assert _parts(line) == [
        "--lora_target_parameters a.w b.w has no equivalent (adapters only: model.lora.target_modules)",
        "--dataset_streaming has no equivalent (prepare tokenizes the whole dataset to disk first)",
    ]
    # the same key in a TRL-style YAML gets the same translation
    (tmp_path / "flat").mkdir()
    flat = write_config(tmp_path / "flat", MINIMAL + "lora_target_modules: [q_proj, v_proj]\n")
    assert [line.split(": ", 1)[1] for line in _errors(flat, [])] == [
        "lora_target_modules: unknown key; TRL's lora_target_modules q_proj,v_proj is "
        "model.lora.target_modules=[q_proj,v_proj]"
    ]


@pytest.mark.parametrize(
    ("dashed", "underscored"),
    [
        (["--warmup-ratio", "0.1"], ["--warmup_ratio", "0.1"]),
        (
            ["--learning-rate", "1e-5", "--per-device-train-batch-size", "8"],
            ["--learning_rate", "1e-5", "--per_device_train_batch_size", "8"],
        ),
        (
            ["--use-peft", "--lora-r", "32", "--report-to", "none"],
            ["--use_peft", "--lora_r", "32", "--report_to", "none"],
        ),
        (["--no-gradient-checkpointing"], ["--gradient_checkpointing", "false"]),
        (["--no_gradient_checkpointing"], ["--gradient_checkpointing", "false"]),
    ],
)
def test_hf_argparser_spellings_are_the_flag(
    dashed: list[str], underscored: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HfArgumentParser takes `--warmup-ratio` for `--warmup_ratio` and `--no_X` for `--X false`: alone they were
    argparse's "unrecognized arguments", beside a translated flag "not a TRL flag known here"."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), *dashed], capsys)
    assert line == _line(["train", str(path), *underscored], capsys)
    if "--warmup-ratio" in dashed:
        assert _parts(line) == [
            "--warmup_ratio 0.1 has no equivalent (no ratio here; set train.warmup_steps to 10% of the run's steps)"
        ]
        return
    config = _loaded(line, path)
    if "--learning-rate" in dashed:
        assert (config.train.lr, config.train.micro_batch_size) == (1e-5, 8)
    elif "--use-peft" in dashed:
        assert (config.model.lora.rank, config.logging.tensorboard) == (32, False)
    else:
        assert config.model.gradient_checkpointing is False


def test_the_users_own_overrides_stay_in_the_suggested_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train cfg.yaml --beta 0.3 train.seed=3` suggested `coati-kto train cfg.yaml kto.beta=0.3`: copied, it
    trained with another seed, unsaid. The user's overrides now follow the translated ones (theirs win)."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--beta", "0.3", "train.seed=3", "kto.beta=0.2"], capsys)
    assert line.endswith(f"coati-kto train {path} kto.beta=0.3 train.seed=3 kto.beta=0.2{TAIL}")
    config = _loaded(line, path)
    assert (config.train.seed, config.kto.beta) == (3, 0.2)


def test_dataset_query_flags_make_one_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--dataset_config en --dataset_train_split train` without --dataset_name became two entries, each named
    after a flag's own value (hf://datasets/en?config=en&split=train, hf://datasets/train?...)."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--dataset_config", "en", "--dataset_train_split", "train"], capsys)
    entry = "data.train_files=hf://datasets/OWNER/NAME?config=en&split=train"
    assert _parts(line) == [
        f"--dataset_config en is config=en in {entry} (OWNER/NAME: the dataset's Hub id)",
        f"--dataset_train_split train is split=train in {entry} (OWNER/NAME: the dataset's Hub id)",
    ]
    assert _loaded(line, path).data.train_files == ["hf://datasets/OWNER/NAME?config=en&split=train"]
    line = _line(["train", str(path), "--dataset_train_split", "train", "--dataset_name", "o/n"], capsys)
    assert _loaded(line, path).data.train_files == ["hf://datasets/o/n?split=train"]


def test_hub_model_id_only_names_the_repo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--push_to_hub false --hub_model_id me/m` gave output.push_to_hub=null output.push_to_hub=me/m: the repo
    name turned uploading on over an explicit false (transformers: push_to_hub defaults to False)."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--push_to_hub", "false", "--hub_model_id", "me/m"], capsys)
    assert _parts(line) == [
        "--push_to_hub false is output.push_to_hub=null",
        "--hub_model_id me/m has no equivalent without --push_to_hub (it only names the repo: transformers uploads "
        "nothing unless push_to_hub is true; with it: output.push_to_hub=me/m)",
    ]
    assert _loaded(line, path).output.push_to_hub is None
    assert _line(["train", str(path), "--hub_model_id", "me/m"], capsys).endswith(
        "none of them has an override here" + TAIL
    )
    line = _line(["train", str(path), "--hub_model_id", "me/m", "--push_to_hub"], capsys)
    assert (
        _parts(line)[0]
        == "--hub_model_id me/m is output.push_to_hub=me/m (the repo --push_to_hub uploads to)"
    )
    assert _loaded(line, path).output.push_to_hub.repo_id == "me/m"


def test_the_commands_own_options_stay_in_the_suggested_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train cfg --nproc-per-node 2 --learning_rate 1e-3` suggested `coati-kto train cfg train.lr=1e-3`, and
    export lost --checkpoint DIR and --push: copied, the command ran on one process, or exported elsewhere."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(
        ["train", str(path), "--nproc-per-node", "2", "--learning_rate", "1e-3", "train.seed=3"], capsys
    )
    assert line.endswith(f"coati-kto train {path} --nproc-per-node 2 train.lr=1e-3 train.seed=3{TAIL}")
    args = _suggested(line)
    assert (args.nproc_per_node, args.overrides) == (2, ["train.lr=1e-3", "train.seed=3"])
    argv = ["export", str(path), "--checkpoint", "out/checkpoints/step-4", "--push", "--hub_model_id", "me/m"]
    line = _line(argv, capsys)
    assert _parts(line) == ["--hub_model_id me/m is output.push_to_hub=me/m (the repo --push uploads to)"]
    assert line.endswith(
        f"coati-kto export {path} --checkpoint out/checkpoints/step-4 --push output.push_to_hub=me/m{TAIL}"
    )
    args = _suggested(line)
    assert (args.checkpoint, args.push) == ("out/checkpoints/step-4", True)
    assert args.overrides == ["output.push_to_hub=me/m"]


def test_max_steps_runs_that_many_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' max_steps overrides num_train_epochs; train.max_steps was a cap inside train.max_epochs
    (default 1), so `--max_steps 30` ran one epoch's steps where TRL ran 30."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--max_steps", "30"], capsys)
    assert _parts(line) == [
        "--max_steps 30 is train.max_steps=30 train.max_epochs=30 (30 optimizer steps, as TRL's max_steps, which "
        "overrides num_train_epochs: train.max_steps is a cap within train.max_epochs here, and 30 epochs hold at "
        "least 30 steps)"
    ]
    train = _loaded(line, path).train
    # one optimizer step per epoch or many: the run (and its LR schedule) spans 30 steps
    for micro_batches in (1, 7, 1000):
        assert planned_steps(micro_batches, 1, train.max_epochs, train.max_steps) == 30
    line = _line(["train", str(path), "--num_train_epochs", "2", "--max_steps", "30"], capsys)
    assert _parts(line)[1] == (
        "--max_steps 30 is train.max_steps=30 (a cap within the train.max_epochs given here; TRL's max_steps "
        "overrides the epoch count: leave that out for 30 steps)"
    )
    assert (_loaded(line, path).train.max_epochs, _loaded(line, path).train.max_steps) == (2, 30)


def test_ratio_and_fractional_values_say_what_to_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--num_train_epochs 1.5` became train.max_epochs=1.5 and `--logging_steps 0.1` train.log_interval=0.1:
    transformers reads a value below 1 as a ratio of the run, and the config refused both."""
    path = write_config(tmp_path, MINIMAL)
    flags = ["--num_train_epochs", "1.5", "--logging_steps", "0.1", "--eval_steps", "0.25"]
    line = _line(["train", str(path), *flags, "--save_steps", "0.5", "--logging_steps", "5"], capsys)
    assert _parts(line) == [
        "--num_train_epochs 1.5 has no equivalent (whole epochs here; set train.max_steps to 1.5 epochs' "
        "optimizer steps, with train.max_epochs=2)",
        "--logging_steps 0.1 has no equivalent (no ratio here; set train.log_interval to 10% of the run's steps)",
        "--eval_steps 0.25 has no equivalent (no ratio here; set train.eval_interval to 25% of the run's steps)",
        "--save_steps 0.5 has no equivalent (no ratio here; set output.save_interval to 50% of the run's steps)",
        "--logging_steps 5 is train.log_interval=5",
    ]
    assert _loaded(line, path).train.log_interval == 5


def test_bf16_beside_lora_flags_keeps_the_trained_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--bf16 --lora_r 8` (LoRA on here without --use_peft) suggested output.export_dtype=fp32, which the config
    refuses with LoRA ("the adapters are exported as trained")."""
    path = write_config(tmp_path, MINIMAL)
    refused = "final/ stays bf16: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false"
    for lora in (["--lora_r", "8"], ["--lora_target_modules", "q_proj", "v_proj"], ["--lora_dropout", "0.1"]):
        line = _line(["train", str(path), "--bf16", *lora], capsys)
        assert _parts(line)[0] == f"--bf16 is plugin.precision=bf16 ({refused})"
        config = _loaded(line, path)
        assert (config.output.export_dtype, config.model.lora is not None) == ("training", True)


def test_older_trl_fields_are_accounted_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--truncation_mode keep_start` alone was argparse's "unrecognized arguments"; KTOConfig's other fields
    and transformers 5's --activation_checkpointing were "not a TRL flag known here"."""
    path = write_config(tmp_path, MINIMAL)
    kept = "a prompt cut to data.max_prompt_length keeps its leading BOS and its end here, as TRL's keep_end"
    assert _line(["train", str(path), "--truncation_mode", "keep_start"], capsys) == (
        f"error: TRL-style flags are not options of coati-kto train: --truncation_mode keep_start has no "
        f"equivalent ({kept}; no keep_start); none of them has an override here{TAIL}"
    )
    flags = ["--truncation_mode", "keep_end", "--label_pad_token_id", "-100", "--padding_value", "0"]
    flags += ["--is_encoder_decoder", "--ref_model_init_kwargs", "{}", "--use_liger_loss"]
    flags += ["--base_model_attribute_name", "model", "--activation_checkpointing"]
    line = _line(["train", str(path), *flags], capsys)
    assert _parts(line) == [
        f"--truncation_mode keep_end is how a prompt is cut here anyway (no key: {kept})",
        "--label_pad_token_id -100 has no equivalent (no label pad id: the loss mask is built from each row's "
        "length)",
        "--padding_value 0 has no equivalent (rows are padded with the tokenizer's pad token, masked by length)",
        "--is_encoder_decoder has no equivalent (decoder-only (causal LM) models only)",
        "--ref_model_init_kwargs {} has no equivalent (the reference loads as the policy does (another one: "
        "model.reference_path))",
        "--use_liger_loss has no equivalent (no logits tensor is formed here anyway)",
        "--base_model_attribute_name model has no equivalent (TRL's Liger loss reads it; no Liger here)",
        "--activation_checkpointing is model.gradient_checkpointing=true",
    ]
    assert _loaded(line, path).model.gradient_checkpointing is True
    line = _line(["train", str(path), "--no-activation-checkpointing"], capsys)
    assert _loaded(line, path).model.gradient_checkpointing is False


def test_fp16_and_bf16_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--fp16 true --bf16 true` became plugin.precision=fp16; transformers refuses the pair."""
    path = write_config(tmp_path, MINIMAL)
    refused = 'is refused, as transformers refuses it ("At most one of fp16 and bf16 can be True"): keep one'
    line = _line(["train", str(path), "--fp16", "true", "--bf16", "true"], capsys)
    assert line == (
        f"error: TRL-style flags are not options of coati-kto train: --fp16 true {refused}; --bf16 true {refused}; "
        f"none of them has an override here{TAIL}"
    )


def test_group_by_length_sampling_is_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--train_sampling_strategy group_by_length` had no equivalent, while data.group_by_length exists."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--train_sampling_strategy", "group_by_length"], capsys)
    assert _parts(line) == ["--train_sampling_strategy group_by_length is data.group_by_length=true"]
    assert _loaded(line, path).data.group_by_length is True
    assert _parts(_line(["train", str(path), "--train_sampling_strategy", "sequential"], capsys)) == [
        "--train_sampling_strategy sequential has no equivalent (the order is seeded (train.seed), both labels in "
        "every micro-batch; group_by_length: data.group_by_length=true)"
    ]


def test_plan_translates_trl_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`coati-kto plan CONFIG --beta 0.2` was argparse's "unrecognized arguments": plan takes a config and
    overrides as train does, and its own options stay in the suggested command."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["plan", str(path), "--gpus", "8", "--beta", "0.2"], capsys)
    assert line == (
        f"error: TRL-style flags are not options of coati-kto plan: --beta 0.2 is kto.beta=0.2; as overrides after "
        f"the config: coati-kto plan {path} --gpus 8 kto.beta=0.2{TAIL}"
    )
    assert (_suggested(line).gpus, _loaded(line, path).kto.beta) == (8, 0.2)


def test_a_flat_trl_yaml_key_is_read_beside_the_others() -> None:
    """trl_hint saw one key of a flat TRL YAML alone: dataset_config never joined dataset_name, and bf16 beside
    use_peft (or a model.lora section) suggested output.export_dtype=fp32, which the config refuses with LoRA."""
    flat = {"dataset_name": "trl-lib/kto", "dataset_config": "en", "model": {"path": "m"}}
    assert trl_hint("dataset_config", "en", siblings=flat) == (
        "TRL's dataset_config en is config=en in data.train_files"
    )
    assert trl_hint("dataset_name", "trl-lib/kto", siblings=flat) == (
        "TRL's dataset_name trl-lib/kto is data.train_files=hf://datasets/trl-lib/kto?config=en"
    )
    refused = "final/ stays bf16: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false"
    for siblings in ({"bf16": True, "use_peft": True}, {"bf16": True, "model": {"lora": {"rank": 4}}}):
        assert (
            trl_hint("bf16", True, siblings=siblings)
            == f"TRL's bf16 true is plugin.precision=bf16 ({refused})"
        )
    # without siblings (and for a key that maps as is) the hint is what it was
    assert trl_hint("bf16", True) == (
        "TRL's bf16 true is plugin.precision=bf16 output.export_dtype=fp32 (fp32 final/ weights, as TRL saves)"
    )
    assert trl_hint("max_steps", 3) is None  # did_you_mean: train.max_steps (a key lost out of train:)


def test_a_flat_trl_yaml_is_read_beside_its_other_keys_at_config_load(tmp_path: Path) -> None:
    """Config load hands the file's top-level keys to each unknown key's line (it passed the key alone)."""
    path = tmp_path / "flat.yaml"
    path.write_text("dataset_name: trl-lib/kto\ndataset_config: en\nbf16: true\nuse_peft: true\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert f"{path}:1: dataset_name: unknown key; TRL's dataset_name trl-lib/kto is " in lines[2]
    assert lines[2].endswith("data.train_files=hf://datasets/trl-lib/kto?config=en"), lines
    assert lines[4].endswith(
        "plugin.precision=bf16 (final/ stays bf16: an fp32 export is refused with LoRA, tp_size > 1 or output.save_final false)"
    ), lines


def test_the_schedule_flags_read_each_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """From an optimizer audit: ``--lr_scheduler_type constant --warmup_steps 5`` was translated as a floor of 1
    with a 5-step warmup, though transformers' constant ignores the warmup; ``cosine_with_min_lr`` with
    ``--lr_scheduler_kwargs '{"min_lr_rate": 0.1}'`` had "no equivalent", though train.min_lr_ratio=0.1 is the same
    curve (min_lr over --learning_rate too)."""
    path = write_config(tmp_path, MINIMAL)
    line = _line(["train", str(path), "--lr_scheduler_type", "constant", "--warmup_steps", "5"], capsys)
    assert _parts(line) == [
        "--lr_scheduler_type constant is train.min_lr_ratio=1.0 train.warmup_steps=0 (transformers' constant "
        "has no warmup)",
        "--warmup_steps 5 is ignored, as transformers' constant schedule ignores it (train.warmup_steps=0 above)",
    ]
    config = _loaded(line, path)
    assert (config.train.min_lr_ratio, config.train.warmup_steps) == (1.0, 0)

    kwargs = ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}']
    line = _line(["train", str(path), *kwargs], capsys)
    assert _parts(line)[0].startswith(
        "--lr_scheduler_type cosine_with_min_lr is train.lr_schedule=cosine train.min_lr_ratio=0.1 ("
    )
    assert "is read into --lr_scheduler_type cosine_with_min_lr's train.min_lr_ratio" in _parts(line)[1]
    assert _loaded(line, path).train.min_lr_ratio == 0.1
    # a config that decays linearly: TRL's cosine is still cosine (from an audit: it decayed linearly)
    (tmp_path / "linear").mkdir()
    linear = write_config(tmp_path / "linear", MINIMAL + "train:\n  lr_schedule: linear\n")
    assert load_config(linear, []).train.lr_schedule == "linear"
    for kind in (kwargs, ["--lr_scheduler_type", "cosine"]):
        assert _loaded(_line(["train", str(linear), *kind], capsys), linear).train.lr_schedule == "cosine"
    by_lr = ["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", '{"min_lr": 2e-6}']
    line = _line(["train", str(path), *by_lr, "--learning_rate", "1e-5"], capsys)
    assert _loaded(line, path).train.min_lr_ratio == pytest.approx(0.2)
    line = _line(["train", str(path), "--lr_scheduler_type", "cosine_with_min_lr"], capsys)
    assert "has no equivalent without its floor" in _parts(line)[0]


def test_config_schema_with_a_trl_flag_suggests_a_command_that_runs() -> None:
    """From a CLI audit: `coati-kto config --schema --beta 0.2` suggested `coati-kto config CONFIG.yaml --schema
    kto.beta=0.2`, which the CLI refuses (--schema takes no config or overrides)."""
    from coati_kto.config.trl_flags import trl_flags_line

    assert trl_flags_line(["config", "--schema", "--beta", "0.2"]) == (
        "TRL-style flags are not options of coati-kto config: --beta 0.2 is kto.beta=0.2; as overrides after the "
        "config: coati-kto config CONFIG.yaml kto.beta=0.2" + TAIL
    )
