"""The environment a launch hands its nodes: ``colossalai run`` rebuilds it as ``export K="V" ...`` in one bash
line that travels over SSH and is printed whole when a node fails. What that line cannot carry (a ``$``, a quote)
and what must not be in it (secret-looking names, a URL's login) is left out, by one rule that
launch/colossalai_run.sh repeats in bash."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_SECRET_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
# AUTH only as a whole '_'-separated part (WANDB__AUTH, HF_AUTH, PROXY_AUTH_X): inside a word it is mostly
# AUTHOR (GIT_AUTHOR_NAME) or XAUTHORITY, names a launch should pass on. PASS and PWD the same (MYSQL_PWD,
# REDIS_PASS; not PASSENGER, PATH, OLDPWD), the shell's own PWD aside.
_SECRET_WORDS = ("AUTH", "OAUTH", "AUTHORIZATION", "PASS", "PWD", "PAT")  # PAT: GITHUB_PAT, a personal token
# A login inside a URL (DATABASE_URL=postgres://user:pw@host/db, a proxy's user:pw@, a token as an https URL's
# user: https://ghp_x@github.com): a secret whatever the name. ssh://git@host names a user, no secret.
URL_LOGIN = re.compile(r"://[^/@\s:]*:[^/@\s]*@|https?://[^/@\s:]+@")
# Paths and settings, not secrets: dropping them breaks the launch or the nodes (SSH_AUTH_SOCK: the launcher's
# own SSH to the nodes uses the agent; the others point at credential files, the documented way to pass them).
_NOT_SECRETS = {"TOKENIZERS_PARALLELISM", "SSH_AUTH_SOCK", "HF_TOKEN_PATH", "GOOGLE_APPLICATION_CREDENTIALS"}
_NOT_SECRETS |= {"AWS_SHARED_CREDENTIALS_FILE", "PWD"}


def is_secret_name(name: str) -> bool:
    """Environment variables kept out of launch command lines and logs: names containing TOKEN, KEY, SECRET,
    PASSWORD, PASSWD or CREDENTIAL, or with AUTH, OAUTH, AUTHORIZATION, PASS, PWD or PAT as a part between
    underscores, any case, except the few in ``_NOT_SECRETS`` (launch/colossalai_run.sh applies the same rule;
    ``unexportable`` adds the values holding a URL's login)."""
    upper = name.upper()
    if upper in _NOT_SECRETS:
        return False
    words = f"_{upper}_"
    return any(part in upper for part in _SECRET_PARTS) or any(f"_{w}_" in words for w in _SECRET_WORDS)


def unexportable(environ: Mapping[str, str]) -> list[str]:
    """The names of ``environ`` that ColossalAI's ``export K="V" ...`` line cannot carry or must not: a value
    holding ``$``, a double quote, a backquote or a backslash (the line breaks, or ``$(...)`` runs on every node),
    secret-looking names (:func:`is_secret_name`) and values holding a URL's login (``URL_LOGIN``), sorted."""
    unsafe = set('$"`\\')
    return sorted(
        k for k, v in environ.items() if unsafe & set(v) or is_secret_name(k) or URL_LOGIN.search(v)
    )


def launcher_env(bin_dir: str | os.PathLike[str], threads: int = 1) -> dict[str, str]:
    """The environment to start ``colossalai run`` with: ``bin_dir`` first on PATH, ``threads`` per process.

    ``colossalai run`` re-creates the environment as ``export K="V" ...`` inside one bash command line, so a
    value holding ``$``, a double quote, a backquote or a backslash breaks the launch (make exports
    ``MAKEOVERRIDES=${-*-command-variables-*-}``: "bad substitution"). Those variables are left out, and so are
    secrets (``is_secret_name``): that line travels over SSH and is printed whole when a node fails. The list
    of names is returned under ``COATI_KTO_DROPPED_ENV`` for the caller to report.
    """
    dropped = unexportable(os.environ)
    kept = {k: v for k, v in os.environ.items() if k not in dropped}
    kept["PATH"] = f"{os.fspath(bin_dir)}{os.pathsep}{os.environ.get('PATH', '')}"
    kept["OMP_NUM_THREADS"] = str(threads)
    kept["COATI_KTO_DROPPED_ENV"] = ",".join(dropped)
    return kept
