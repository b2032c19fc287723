"""User-facing errors: one line, no traceback, non-zero exit (see coati_kto.cli.main)."""

from __future__ import annotations

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


class ConfigError(UserError):
    """One or more problems in the YAML config or its command-line overrides."""

    same_on_every_rank = True


class DataError(UserError):
    """A record that cannot be read or used; the message names ``file:line`` and the field."""
