"""``plugin.name: gemini``: known by name, refused with the reason (config load refuses it first)."""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from coati_kto.config.schema import GEMINI_REFUSAL
from coati_kto.errors import ConfigError
from coati_kto.parallel.backends.base import ParallelBackend


class GeminiBackend(ParallelBackend):
    """Refused: ``GEMINI_REFUSAL`` says why. Each way in (a plugin built by hand, ``ParallelPlan.from_plugin``)
    raises that one line. What lifting the refusal would have to change is said here: Gemini keeps parameters
    and gradients in chunks released outside the forward, so the chunked LM head cannot read its weight and
    the gradient norm cannot be read from ``p.grad``; accumulation needs its own gradient-accumulation mode."""

    name = "gemini"
    plugin_class = "GeminiPlugin"

    @property
    def no_sync_accumulation(self) -> bool:
        return False

    @property
    def chunked_head(self) -> bool:
        return False

    def refuse(self) -> NoReturn:
        """ConfigError with the reason, in one line."""
        raise ConfigError(GEMINI_REFUSAL)

    def build_plugin(self) -> Any:
        self.refuse()

    def grad_norm(self, optimizer: Any, layout: Any, max_norm: float | None = None) -> Any:
        self.refuse()

    def boost(
        self, booster: Any, policy: nn.Module, optimizer: Any, lr_scheduler: Any
    ) -> tuple[Any, Any, Any]:
        self.refuse()

    def build_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        self.refuse()
