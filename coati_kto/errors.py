"""User-facing errors: one line, no traceback, non-zero exit (see coati_kto.cli.main)."""

from __future__ import annotations

import re
from typing import Any

USER_ERROR_EXIT_CODE = (
    2  # the CLI's exit status for a UserError; a launcher whose ranks exit so returns it too
)
# Trained and saved, but output.push_to_hub's upload failed (everything on disk; the line printed says how to retry).
PUSH_FAILED_EXIT_CODE = 3


class UserError(Exception):
    """A mistake in the user's input (config, data, command line).

    The CLI prints ``error: <message>`` on one line and exits with status 2; the message must name
    the file, line and field where it can.
    """

    # True when every rank raises the same error (config, checkpoint agreement): only rank 0 prints it.
    same_on_every_rank = False

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as (class, message, attributes), never by calling the constructor again: a subclass's
        ``__init__`` may take other arguments than the message (RecordError's), and ``on_rank0`` sends rank 0's
        error to the other ranks whatever its class."""
        return (rebuild_user_error, (type(self), str(self), dict(self.__dict__)))


def rebuild_user_error(cls: type[UserError], message: str, state: dict[str, Any]) -> UserError:
    """A ``cls`` holding ``message`` and ``state`` (its attributes), made without calling ``cls.__init__``."""
    err = cls.__new__(cls)
    err.args = (message,)
    err.__dict__.update(state)
    return err


class ConfigError(UserError):
    """One or more problems in the YAML config or its command-line overrides."""

    same_on_every_rank = True


class DataError(UserError):
    """A record that cannot be read or used; the message names ``file:line`` and the field."""


class NonFiniteLossError(UserError):
    """A NaN/inf loss or gradient norm with ``train.on_nonfinite: stop``; raised on every rank at the same step,
    before any update."""

    @classmethod
    def at(cls, step: int, epoch: int, bad_grad: bool, last_checkpoint: object) -> NonFiniteLossError:
        """The error of optimizer step ``step``: what was non-finite, the checkpoint kept, what to do."""
        kept = (
            f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was saved"
        )
        what = "gradient norm" if bad_grad else "KTO loss"
        return cls(
            f"non-finite (NaN/inf) {what} at optimizer step {step} (epoch {epoch}); stopped before updating "
            f"the weights, {kept}. Lower train.lr, check the data, or set train.on_nonfinite=skip"
        )


# A value given to a key or flag named for a token (--hub_token X, output.hub_token=X, TRL's hub_token X), and
# anything shaped like a Hugging Face access token (hf_ and 30 or more letters and digits).
_NAMED_SECRET = re.compile(r"(?i)(\b(?:hub|hf|api|auth|access)_token|--token|\.token)([ =])([^\s:;,()]+)")
_TOKEN_SHAPED = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")


def without_secrets(text: str) -> str:
    """``text`` (a line to print) with the Hugging Face token and any value given to a token-named key or flag
    replaced by ``***``: an error that echoes a command line must not print the token it holds."""
    from huggingface_hub import get_token  # the token HF_TOKEN or `hf auth login` gives

    text = _TOKEN_SHAPED.sub("hf_***", _NAMED_SECRET.sub(r"\1\2***", text))
    token = get_token()
    return text.replace(token, "***") if token else text
