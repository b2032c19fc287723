"""Third-party notices that say nothing about the user's run, silenced by their exact text; every other shows.

``quiet_known_warnings`` (Python warnings and module loggers; call before anything imports ColossalAI, which
warns at import time) and ``quiet_known_logs`` (ColossalAI's DistributedLogger). Both are idempotent.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

# Third-party notices that say nothing about the user's run, printed on every rank (and every step for the
# torch deprecations ColossalAI 0.5.0 triggers): optional kernels absent on CPU, renamed torch collectives.
_KNOWN_NOISE = (
    (UserWarning, r"Please install (the latest tensornvme|apex from source)"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    (FutureWarning, r"`broadcast_buffers` is deprecated"),
    # peft 0.18 reads transformers 5's deprecated property as it wraps a model for LoRA (twice a run).
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)


# The same, sent through ColossalAI's DistributedLogger rather than warnings.warn. Its ``warning`` logs two
# records, "<file>:<line> <function>" and then the message, so a logging.Filter on the message alone would
# leave the location line behind: the message is dropped before either is logged. The hybrid plugin warns
# "Use Zero Optimizer when data parallel size is 1 ..." on a 1-process run that keeps ZeRO (cpu_offload).
# Its enable_lora nags "You have enabled LoRa training. Please check the hyperparameters such as lr" on every rank.
_KNOWN_LOG_NOISE = (
    re.compile(r"Use Zero Optimizer when data parallel size is 1"),
    re.compile(r"You have enabled LoRa training"),
)

# Python loggers of third-party modules, by logger name: the records to drop. bitsandbytes (imported by
# ColossalAI's GaLore, at import time) 0.50 warns on CPUs with AVX512-BF16 that the optional `kernels` package
# for its 4-bit CPU GEMM is absent; nothing here quantizes.
_KNOWN_LOGGER_NOISE = {
    "bitsandbytes.backends.cpu.ops": re.compile(
        r"Failed to load CPU gemm_4bit_forward from kernels-community"
    ),
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_known_warnings() -> None:
    """Silence only the notices listed above; every other warning still shows. Idempotent."""
    for category, message in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in _KNOWN_LOGGER_NOISE.items():
        logger = logging.getLogger(name)  # the module's own logger, before it is imported
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))


def quiet_known_logs() -> None:
    """Drop ColossalAI's DistributedLogger warnings listed in _KNOWN_LOG_NOISE; every other one still shows,
    with its caller's location as upstream prints it. Idempotent; imports colossalai.logging."""
    from colossalai.logging import DistributedLogger

    if getattr(DistributedLogger.warning, "_coati_quiet", False):
        return

    def warning(self: DistributedLogger, message: str, ranks: list[int] | None = None) -> None:
        if any(p.match(str(message)) for p in _KNOWN_LOG_NOISE):
            return
        caller = sys._getframe(1)  # upstream's prefix: the caller's file, line and function
        code = caller.f_code
        self._log("warning", f"{code.co_filename}:{caller.f_lineno} {code.co_name}", ranks)
        self._log("warning", message, ranks)

    warning._coati_quiet = True  # type: ignore[attr-defined]
    DistributedLogger.warning = warning
