"""The MoE router's load-balancing loss (Switch Transformer, Fedus et al. 2021, Eq. 4-6) in the project's passes:
what transformers' MoE causal LMs add to their loss when ``output_router_logits`` is on, computed from the
router logits of the policy's gradient pass over the tokens that pass holds for the examples.

transformers 5.24's ``load_balancing_loss_func`` (one copy per family: Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
Qwen 3.5-MoE, OLMoE, GPT-OSS, PhiMoE, GraniteMoE, Jamba, JetMoE, MiniMax, Ernie 4.5-MoE, FlexOlmo, ...) pools
every router layer's tokens: with p = softmax(router logits) per token and T the top-k experts it picks,

    aux = E * sum_e f_e P_e,  f_e = sum_{l,t} w_t [e in T_lt] / sum_{l,t} w_t,  P_e = sum_{l,t} w_t p_lte / sum_{l,t} w_t

with w_t its 2D ``attention_mask`` (padding excluded). Here w_t is 1 on the tokens of the examples' documents
and 0 on padding, on the packed rows' padding columns and on a folded pass's KL-pair tokens
(``coati_kto.models.packing.example_tokens``), so the loss is the one transformers computes on the examples'
padded batch, whichever layout ran. Families whose module has no such function (DeepSeek-V3 and GLM-4-MoE
balance with a bias, not a loss; Llama 4) or another one (Doge) have none here either.

The router logits come from forward hooks on the modules transformers records them from
(``_can_record_outputs["router_logits"]``), held only while the gradient pass runs (:meth:`RouterLoss.capture`):
the reference's and the no-grad passes never record, and the model is called without ``output_router_logits``
(transformers' own loss reads a 2D mask; the passes give 4D masks or packed rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from coati_kto.errors import ConfigError
from coati_kto.families import switch_aux_loss
from coati_kto.models.lora import base_module


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def _experts(module: torch.nn.Module) -> tuple[int, int] | None:
    """(experts per router, experts each token is routed to) as the causal LM passes them to its loss."""
    text = _text_config(module.config)
    experts = getattr(module, "num_experts", None) or getattr(text, "num_experts", None)
    experts = experts or getattr(text, "num_local_experts", None)
    top_k = getattr(module, "num_experts_per_tok", None) or getattr(text, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if isinstance(experts, int) and isinstance(top_k, int) else None


def _router_modules(module: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(module, index of the router logits in its output) for every module transformers records
    ``router_logits`` from: each submodel's ``_can_record_outputs`` spec (target class or class-name suffix,
    optional layer name), matched as transformers' output capturing matches it."""
    specs = []
    for sub in module.modules():
        spec = (getattr(type(sub), "_can_record_outputs", None) or {}).get("router_logits")
        specs += spec if isinstance(spec, list) else [spec] if spec is not None else []
    found: dict[int, tuple[torch.nn.Module, int]] = {}
    for name, sub in module.named_modules():
        for spec in specs:
            target, class_name = getattr(spec, "target_class", spec), getattr(spec, "class_name", None)
            if isinstance(target, str):  # a bare class-name spec (index 1, as transformers reads it)
                target, class_name = None, target
            hit = (isinstance(target, type) and isinstance(sub, target)) or (
                class_name is not None and name.endswith(class_name)
            )
            layer = getattr(spec, "layer_name", None)
            if hit and (layer is None or f".{layer.strip('.')}." in f".{name}."):
                found.setdefault(id(sub), (sub, getattr(spec, "index", 1)))
    return list(found.values())


def _adapted_routers(module: torch.nn.Module, routers: list[tuple[torch.nn.Module, int]]) -> list[str]:
    """The names of the router modules peft put LoRA adapters on, inside or around (target_parameters wraps the
    router): under ``model.lora`` every router is otherwise a frozen base weight."""
    names = {id(m): n for n, m in module.named_modules()}
    tuned = [n for n, m in module.named_modules() if hasattr(m, "lora_A") or hasattr(m, "lora_B")]
    found = []
    for router, _ in routers:
        name = names.get(id(router), "")
        hit = [t for t in tuned if t == name or name.startswith(t + ".") or t.startswith(name + ".")]
        found += [name.removesuffix(".base_layer").rsplit(".", 1)[-1]] if hit else []
    return sorted(set(found))


def load_balancing_loss(
    router_logits: list[torch.Tensor], tokens: torch.Tensor, num_experts: int, top_k: int
) -> torch.Tensor:
    """The Switch load-balancing loss, fp32 0-dim, as transformers 5.24 computes it (module docstring).

    ``router_logits``: one [T, E] (or [..., E] over the same T tokens) tensor per router layer; ``tokens`` [T]
    (any shape of T elements): 1 on the tokens that count, 0 elsewhere. The softmax runs in the logits' dtype,
    its sums in fp32, as transformers does, so a bf16 router picks the experts transformers' would.
    """
    weights = tokens.reshape(-1).float()
    counts = torch.zeros(num_experts, dtype=torch.float32, device=weights.device)
    probs = torch.zeros_like(counts)
    for logits in router_logits:
        routing = torch.softmax(logits.reshape(-1, num_experts).to(weights.device), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), weights.repeat_interleave(top_k))
        probs = probs + (routing.float() * weights[:, None]).sum(0)
    total = weights.sum() * len(router_logits)
    return (counts / total * (probs / total)).sum() * num_experts


@dataclass
class RouterLoss:
    """The policy's load-balancing loss, found once per model (:meth:`find`): ``coefficient`` x the loss of each
    gradient pass joins the KTO loss. Every rank holds one (same model, same answer)."""

    coefficient: float
    num_experts: int
    top_k: int
    modules: list[tuple[torch.nn.Module, int]] = field(repr=False)
    _paused: bool = field(default=False, repr=False)

    @classmethod
    def supported(cls, model: Any) -> RouterLoss | None:
        """The model's loss with its own ``router_aux_loss_coef``, or None when its family has no Switch
        load-balancing loss in transformers (or no router logits to record)."""
        module = base_module(model)
        if not switch_aux_loss(type(module).__module__):
            return None
        experts, modules = _experts(module), _router_modules(module)
        if experts is None or not modules:
            return None
        text = _text_config(module.config)
        # As the causal LM holds it (DBRX's from its ffn_config, JetMoE's named aux_loss_coef), else its config's.
        coefficient = getattr(module, "router_aux_loss_coef", None) or getattr(module, "aux_loss_coef", None)
        coefficient = (
            coefficient or getattr(text, "router_aux_loss_coef", None) or getattr(text, "aux_loss_coef", 0)
        )
        return cls(float(coefficient or 0.0), *experts, modules)

    @classmethod
    def find(cls, model: Any, setting: float | str) -> RouterLoss | None:
        """The loss a run adds for ``kto.router_aux_loss_coef`` = ``setting``: ``auto`` the model's coefficient
        when its config asks for router logits (TRL's and transformers' rule), a number that coefficient
        (0: off). None when nothing is added; ConfigError for a number > 0 on a model without the loss."""
        loss, module = cls.supported(model), base_module(model)
        if setting == "auto":
            asks = getattr(_text_config(module.config), "output_router_logits", False)
            loss = loss if loss is not None and asks and loss.coefficient > 0 else None
        elif float(setting) == 0:
            loss = None
        elif loss is None:
            raise ConfigError(
                f"kto.router_aux_loss_coef {setting}: {type(module).__name__} has no router load-balancing loss "
                "in transformers 5.24 (set it to auto or 0)"
            )
        else:
            loss.coefficient = float(setting)
        adapted = _adapted_routers(module, loss.modules) if loss is not None else []
        if (
            adapted
        ):  # the hooks would record the base router's logits, or the adapted ones: not tested either way
            raise ConfigError(
                f"model.lora.target_modules: adapters on the MoE router ({', '.join(adapted)}) with its "
                "load-balancing loss are not supported: drop the router from target_modules (it stays frozen, "
                "and the loss still reaches the adapters before it) or set kto.router_aux_loss_coef=0"
            )
        return loss

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Record the router logits of the forwards run inside (one tensor per router call, in order)."""
        logits: list[torch.Tensor] = []

        def hook(module, args, output, index):
            if not self._paused:
                logits.append(output[index] if isinstance(output, tuple) else output)

        handles = [m.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i)) for m, i in self.modules]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within a :meth:`capture`: forwards whose router logits no loss reads (a continued KL pass) record
        nothing."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def loss(self, logits: list[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """The unscaled load-balancing loss (fp32 0-dim) of one forward's ``logits`` over ``tokens`` (its [R, L]
        mask: 1 on the examples' tokens). RuntimeError when the routers did not each run once."""
        if len(logits) != len(self.modules):
            raise RuntimeError(f"{len(logits)} router outputs recorded for {len(self.modules)} routers")
        return load_balancing_loss(logits, tokens, self.num_experts, self.top_k)
