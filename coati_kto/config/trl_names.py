"""TRL's names for its settings (KTOConfig, transformers' TrainingArguments, TRL's ScriptArguments and
ModelConfig) and what each one is here: a key, a switch, a value-dependent translation, or no equivalent and why.
``coati_kto.config.trl_flags`` reads a command line or a TRL-style YAML key with them.
"""

from __future__ import annotations

# The names TRL's KTOConfig and transformers' TrainingArguments give these settings: users bring them along.
TRAINER_NAMES = {
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "train.micro_batch_size",
    "per_device_eval_batch_size": "train.eval_micro_batch_size",
    "gradient_accumulation_steps": "train.accumulation_steps",
    "num_train_epochs": "train.max_epochs",
    "warmup_steps": "train.warmup_steps",
    "max_grad_norm": "train.max_grad_norm",
    "logging_steps": "train.log_interval",
    "eval_steps": "train.eval_interval",
    "save_steps": "output.save_interval",
    "save_total_limit": "output.keep_last",
    "output_dir": "output.dir",
    "max_prompt_length": "data.max_prompt_length",
    "max_length": "data.max_length",
    "dataset_num_proc": "data.num_proc",
    "pad_to_multiple_of": "data.pad_to_multiple_of",
    "dataloader_num_workers": "train.num_workers",
    "ddp_timeout": "train.dist_timeout",
    "beta": "kto.beta",
    "desirable_weight": "kto.desirable_weight",
    "undesirable_weight": "kto.undesirable_weight",
    "precompute_ref_batch_size": "kto.precompute_batch_size",
    "router_aux_loss_coef": "kto.router_aux_loss_coef",
}
# TRL's script flags (ScriptArguments, ModelConfig) and TrainingArguments flags not in TRAINER_NAMES -> the key.
SCRIPT_FLAGS = {
    "model_name_or_path": "model.path",
    "model_revision": "model.path",  # a Hub model is pinned by downloading that revision to a directory
    "trust_remote_code": "model.trust_remote_code",
    "gradient_checkpointing": "model.gradient_checkpointing",
    "activation_checkpointing": "model.gradient_checkpointing",  # transformers 5's name for the same switch
    "attn_implementation": "model.attn_implementation",
    "dataset_name": "data.train_files",
    "seed": "train.seed",
    "max_steps": "train.max_steps",
    "weight_decay": "train.weight_decay",
    "resume_from_checkpoint": "train.resume",
    "lora_r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "loss_type": "kto.loss_type",
}
# Flags whose value goes into the hf://datasets entry of --dataset_name, as its query.
DATASET_QUERY = {"dataset_config": "config", "dataset_train_split": "split", "dataset_revision": "revision"}
# What TRL's --generate_during_eval turns on: TRL decodes one eval batch (8 rows at transformers' default
# per_device_eval_batch_size); here a fixed, seeded set of that many prompts.
GENERATED_SAMPLES = 8
# TRL's ModelConfig LoRA defaults (trl/trainer/model_config.py: lora_r 16, lora_alpha 32, lora_dropout 0.05).
TRL_LORA = "model.lora={rank: 16, alpha: 32, dropout: 0.05}"
# Flags TRL takes bare (``--bf16``: true) or with a boolean -> the override for true, and for false.
SWITCHES = {
    "gradient_checkpointing": ("model.gradient_checkpointing=true", "model.gradient_checkpointing=false"),
    "activation_checkpointing": ("model.gradient_checkpointing=true", "model.gradient_checkpointing=false"),
    "trust_remote_code": ("model.trust_remote_code=true", "model.trust_remote_code=false"),
    "bf16": ("plugin.precision=bf16", "plugin.precision=fp32"),  # both resolved together by _precision
    "fp16": ("plugin.precision=fp16", "plugin.precision=bf16"),
    "use_peft": (TRL_LORA, "model.lora=null"),
    "push_to_hub": ("output.push_to_hub=OWNER/NAME", "output.push_to_hub=null"),
    "generate_during_eval": (f"eval.samples={GENERATED_SAMPLES}", "eval.samples=0"),
    "precompute_ref_log_probs": ("kto.reference=cached", "kto.reference=online"),
    "torch_compile": ("model.compile=true", "model.compile=false"),
    "eval_on_start": ("train.eval_at_start=true", "train.eval_at_start=false"),
}
SWITCH_NOTES = {
    "use_peft": "TRL's LoRA defaults",
    "generate_during_eval": f"{GENERATED_SAMPLES} prompts decoded at each evaluation",
    "precompute_ref_log_probs": "train computes the cache first, or coati-kto precompute CONFIG ahead",
}
# TRL / transformers flags with no equivalent here -> why (in a few words), or what to set instead.
_UNMAPPED = [
    ("max_completion_length", "no such key: a completion keeps what data.max_length leaves after its prompt"),
    ("logging_first_step", "train/ metrics every train.log_interval steps"),
    ("logging_strategy", "set train.log_interval"),
    ("logging_dir", "TensorBoard writes under output.dir/tensorboard"),
    ("eval_strategy evaluation_strategy", "set train.eval_interval, train.eval_at_epoch_end"),
    ("save_strategy", "set output.save_interval (0: at the end only)"),
    ("save_only_model", "checkpoints always hold the optimizer state"),
    ("run_name", "W&B names the run; logging.wandb_project sets the project"),
    ("optim", "AdamW only (train.fused_optimizer fuses it)"),
    ("adam_beta1 adam_beta2 adam_epsilon", "AdamW's betas (0.9, 0.999) and eps 1e-8 are fixed"),
    ("lr_scheduler_kwargs", "the decay's floor is train.min_lr_ratio"),
    ("tf32", "TF32 is not switched here"),
    ("deepspeed fsdp", "ColossalAI plugins here: plugin.name, plugin.zero_stage"),
    ("bf16_full_eval fp16_full_eval", "evaluation runs in plugin.precision"),
    ("data_seed", "train.seed seeds the data order too"),
    ("do_train", "train always trains"),
    ("do_eval", "evaluation runs with data.eval_files or data.eval_fraction"),
    ("dataset_test_split", "eval data: data.eval_files=[hf://datasets/OWNER/NAME?split=test]"),
    ("disable_dropout", "dropout is always off here"),
    ("remove_unused_columns", "prepare reads its fields and names the unread ones"),
    ("use_liger_kernel use_liger_loss", "no logits tensor is formed here anyway"),
    ("base_model_attribute_name", "TRL's Liger loss reads it; no Liger here"),
    ("activation_offloading torch_empty_cache_steps", "not offered"),
    ("sync_ref_model ref_model_mixup_alpha ref_model_sync_steps", "the reference stays fixed (no TR-DPO)"),
    ("model_init_kwargs torch_dtype dtype", "weights load in plugin.precision"),
    ("ref_model_init_kwargs", "the reference loads as the policy does (another one: model.reference_path)"),
    ("is_encoder_decoder", "decoder-only (causal LM) models only"),
    ("label_pad_token_id", "no label pad id: the loss mask is built from each row's length"),
    ("padding_value", "rows are padded with the tokenizer's pad token, masked by length"),
    (
        "load_in_4bit load_in_8bit use_bnb_nested_quant bnb_4bit_quant_type bnb_4bit_quant_storage",
        "no quantized training",
    ),
    ("use_rslora use_dora lora_task_type", "plain causal-LM LoRA only"),
    ("lora_modules_to_save lora_target_parameters", "adapters only: model.lora.target_modules"),
    ("hub_strategy", "output.push_to_hub={repo_id: OWNER/NAME, checkpoints: true} uploads each checkpoint"),
    ("hub_private_repo", "output.push_to_hub={repo_id: OWNER/NAME, private: BOOL}"),
    ("hub_token", "hf auth login or HF_TOKEN"),
    ("dataset_streaming", "prepare tokenizes the whole dataset to disk first"),
    ("ignore_bias_buffers", "a torch DDP workaround; ColossalAI plugins here"),
    ("label_names", "a record's label is its label field"),
    ("include_for_metrics", "no compute_metrics: eval/ logs TRL's KTO metrics"),
]
NO_EQUIVALENT = {name: why for names, why in _UNMAPPED for name in names.split()}
# TRL flags whose translation depends on the value (trl_flags._valued).
VALUED = ("lr_scheduler_type", "warmup_ratio", "report_to", "lora_target_modules", "train_sampling_strategy")
VALUED += ("truncation_mode", "hub_model_id")
# transformers reads these below 1 as a ratio of the run's steps (TrainingArguments: "a float in range [0,1)").
RATIO_STEPS = ("logging_steps", "eval_steps", "save_steps")
# The boolean flags among the unmapped: a bare one takes no value (``--logging_first_step train.seed=1``).
BOOLEAN = {*SWITCHES, "logging_first_step", "save_only_model", "do_train", "do_eval", "disable_dropout"}
BOOLEAN |= {"remove_unused_columns", "use_liger_kernel", "activation_offloading", "sync_ref_model", "tf32"}
BOOLEAN |= {"bf16_full_eval", "fp16_full_eval", "load_in_4bit", "load_in_8bit", "use_bnb_nested_quant"}
BOOLEAN |= {"use_rslora", "use_dora", "hub_private_repo", "dataset_streaming", "ignore_bias_buffers"}
BOOLEAN |= {"use_liger_loss", "is_encoder_decoder"}
KNOWN = {*TRAINER_NAMES, *SCRIPT_FLAGS, *DATASET_QUERY, *SWITCHES, *NO_EQUIVALENT, *VALUED}
# TRL's list-valued flags (HfArgumentParser's nargs="+"): each takes every value up to the next option,
# override or config file. report_to is one str in recent transformers (a list in older ones): read alike.
LIST_FLAGS = {"report_to", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save"}
LIST_FLAGS |= {"label_names", "include_for_metrics"}
