"""The trained model as a Hugging Face directory: the weights ``export_hf`` gathered (or their fp32 masters) with
the config and tokenizer, written by the main rank only (``trainer.checkpoint.CheckpointManager.export_hf``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coati_kto.models.hf import copy_processor_files, stored_dtype_everywhere
from coati_kto.parallel.distributed import comm_device


def write_hf(module: Any, state: dict, tokenizer: Any, out: Path, fp32: bool) -> None:
    """``module`` with ``state`` and ``tokenizer`` as a Hugging Face model directory ``out`` (replaced)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # save_pretrained drops tied duplicates that safetensors refuses, and writes config's dtype.
    module.save_pretrained(out, state_dict=state, safe_serialization=True)
    # config.json names the module's (working) dtype: say what is stored, in every sub-config too
    stored_dtype_everywhere(out / "config.json", "float32" if fp32 else None)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    copy_processor_files(getattr(module.config, "_name_or_path", ""), module.config, out)


def fp32_state(state: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every parameter replaced by its fp32 master and other floats cast to fp32; tied entries
    (one tensor under two names) stay one tensor."""
    by_storage = {state[name].data_ptr(): master for name, master in masters.items() if name in state}
    out = {}
    for key, value in state.items():
        replaced = by_storage.get(value.data_ptr())
        out[key] = (
            replaced if replaced is not None else (value.float() if value.is_floating_point() else value)
        )
    return out


def write_atomic(path: Path, text: str) -> None:
    """``text`` as ``path``, renamed into place once on disk (a reader sees the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def merged_over_stages(
    state: dict[str, torch.Tensor], module: Any, group: Any, keep: bool = True
) -> dict[str, torch.Tensor]:
    """The whole model's ``state`` (host tensors) from each pipeline stage's own: each stage holds its layers'
    tensors only. Every rank of ``group`` calls and gets the whole state, in host memory; with ``keep`` False it
    only sends its own and gets ``{}`` (a rank that will not write: a 70B model is 140 GB of host memory per
    rank). A tied LM head is held by the last stage and its embedding by the first, both with the same values:
    the tied name is dropped, as ``save_pretrained`` does.

    The names, shapes and dtypes go through an object all-gather; the tensors through one broadcast each, from
    the stage that holds it. Not the state itself as an object: on NCCL an object collective stages every
    rank's pickle in GPU memory at once (pp times the largest stage on every rank, beside the trained model)."""
    listed: list[list[tuple[str, tuple[int, ...], torch.dtype]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(listed, [(k, tuple(v.shape), v.dtype) for k, v in state.items()], group=group)
    device, own = comm_device(), dist.get_rank(group)
    merged: dict[str, torch.Tensor] = {}
    for stage, names in enumerate(listed):
        source = dist.get_global_rank(group, stage)
        for name, shape, dtype in names or []:
            if stage == own:
                tensor = state[name]
                dist.broadcast(_wire(tensor.to(device).contiguous()), src=source, group=group)
            else:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(_wire(tensor), src=source, group=group)
            if keep:  # else dropped as it arrives
                merged[name] = tensor.cpu()
    tied = getattr(module, "_tied_weights_keys", None) or {}
    if isinstance(tied, dict) and getattr(module.config.get_text_config(), "tie_word_embeddings", False):
        for alias, source in tied.items():
            if alias in merged and source in merged:
                del merged[alias]
    return merged


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a collective carries it: a bool buffer as its bytes (gloo has no bool type), else itself."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def save_tied_weights_once(module: torch.nn.Module) -> None:
    """Make ``module``'s state dict hold a weight shared by several names (tied input/output embeddings) once,
    the way ``save_pretrained`` does; loading fills the other names from it. Idempotent.

    safetensors refuses tensors that share memory, and the checkpoint IO of the backends without tensor
    parallelism saves ``state_dict()`` as it is. The first name in ``named_parameters`` order is kept (``model.embed_tokens.weight``
    before ``lm_head.weight``, as in transformers' exports); the tie itself lives in the module (one Parameter
    under both names), so a resumed model stays tied.
    """
    if getattr(module, "_coati_tied_hooks", False):
        return
    module._coati_tied_hooks = True
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}  # alias -> kept name
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    if not aliases:
        return

    def drop_aliases(_module: torch.nn.Module, state: dict, prefix: str, _meta: Any) -> None:
        for alias in aliases:
            state.pop(prefix + alias, None)

    def fill_aliases(state: dict, prefix: str, *_args: Any) -> None:
        # Called per checkpoint shard: an alias is filled from its source where the shard holds it.
        for alias, kept in aliases.items():
            if prefix + kept in state and prefix + alias not in state:
                state[prefix + alias] = state[prefix + kept]

    module._register_state_dict_hook(drop_aliases)
    module._register_load_state_dict_pre_hook(fill_aliases)
