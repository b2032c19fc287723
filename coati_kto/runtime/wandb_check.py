"""Whether ``logging.wandb`` can start, checked before anything heavy (``coati_kto.runtime.preflight``): the package,
and for an online run the API key wandb.init would find. Without one, wandb.init raised on global rank 0 after
the data was prepared and the model loaded: a traceback, and tensorboard/ events that refused the retry."""

from __future__ import annotations

import configparser
import importlib.util
import os
from pathlib import Path

from coati_kto.config.output import LoggingSection

DEFAULT_HOST = "https://api.wandb.ai"


def wandb_problems(logging: LoggingSection) -> list[str]:
    """One line per problem (none when ``logging.wandb`` is off or will start)."""
    if not logging.wandb:
        return []
    if importlib.util.find_spec("wandb") is None:
        return [
            "logging.wandb: true, but the wandb package is not installed: pip install wandb, or set logging.wandb=false"
        ]
    if logging.wandb_mode != "online" or _has_key(os.environ.get("WANDB_BASE_URL", DEFAULT_HOST)):
        return []
    return [
        f"logging.wandb: no W&B API key for {os.environ.get('WANDB_BASE_URL', DEFAULT_HOST)} (WANDB_API_KEY, "
        "`wandb login`'s ~/.netrc, or wandb's settings file): set one, or logging.wandb_mode=offline"
    ]


def _has_key(host: str) -> bool:
    """Where wandb.init looks, in its order: the environment, the netrc file, wandb's settings file. True when the
    lookup itself fails (a wandb whose internals moved: wandb.init then says it)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        if read_netrc_auth(host=host):
            return True
    except Exception:  # noqa: BLE001 - any failure of wandb's own lookup is wandb.init's to report
        return True
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb")
    settings = configparser.ConfigParser()
    try:
        settings.read(config_dir / "settings")
    except configparser.Error:
        return True
    return bool(settings.get("default", "api_key", fallback=""))
