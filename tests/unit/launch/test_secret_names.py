"""Which environment variables a launch keeps off the nodes' command line: ``is_secret_name`` (the Python
launchers) and launch/colossalai_run.sh (bash) apply one rule, checked here on the same names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from coati_kto.parallel.launch_env import is_secret_name, unexportable

REPO = Path(__file__).resolve().parents[3]
PREFIX = "colossalai_run.sh: not passed to the nodes (secret-looking names): "

SECRETS = [
    "HF_TOKEN",
    "WANDB_API_KEY",
    "AWS_SECRET_ACCESS_KEY",
    "DB_PASSWORD",
    "PGPASSWD",
    "AWS_PROFILE_CREDENTIALS",
    "AZURE_CREDENTIAL",
    "WANDB__AUTH",
    "HF_AUTH",
    "auth",
    "PROXY_AUTH_HEADER",
    "GITHUB_OAUTH",
    "HTTP_AUTHORIZATION",
    "netrc_passwd",
    "MYSQL_PWD",
    "REDIS_PASS",
    "smtp_pass",
    "GITHUB_PAT",  # a personal access token (from a security audit: it reached the failure line)
]
# Values holding a URL's login are secrets whatever the name (from a security audit: DATABASE_URL reached the line).
LOGIN_VALUES = {
    "DATABASE_URL": "postgres://u:auditdbpw@h/db",
    "HTTPS_PROXY": "http://me:pw@proxy:3128",
    "REDIS_URL": "redis://:pw@cache:6379",
    "REPO_URL": "https://ghp_abc123@github.com/o/r.git",  # a token as the user (the review of this rule)
}
PLAIN_URLS = {
    "HF_ENDPOINT": "https://hub.example:8443/x",
    "NO_PROXY": "localhost,127.0.0.1",
    "MAILTO": "a@b.c",
}
PLAIN_URLS |= {
    "GIT_REMOTE": "ssh://git@host:22/x",
    "ORIGIN": "git@github.com:o/r.git",
    "SSH_TARGET": "user@host",
}
HARMLESS = [
    "GIT_AUTHOR_NAME",
    "GIT_AUTHOR_EMAIL",
    "AUTHOR",
    "XAUTHORITY",
    "SSH_AUTH_SOCK",  # colossalai run's own SSH to the nodes uses the agent
    "TOKENIZERS_PARALLELISM",
    "HF_TOKEN_PATH",  # paths to credential files: the documented way to give the nodes credentials
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AWS_SHARED_CREDENTIALS_FILE",
    "OMP_NUM_THREADS",
    "NCCL_SOCKET_IFNAME",
    "PWD",  # the shell's working directory
    "OLDPWD",
    "PASSENGER_APP_ENV",
    "PATH_INFO",
    "PATTERN",
]


@pytest.mark.parametrize("name", SECRETS)
def test_secret_looking_names_are_kept_off_the_command_line(name: str) -> None:
    assert is_secret_name(name)
    assert unexportable({name: "plain"}) == [name]


def test_a_urls_login_is_a_secret_in_any_name() -> None:
    assert unexportable({**LOGIN_VALUES, **PLAIN_URLS}) == sorted(LOGIN_VALUES)


@pytest.mark.parametrize("name", HARMLESS)
def test_harmless_names_are_passed_on(name: str) -> None:
    assert not is_secret_name(name)


def test_the_bash_script_drops_exactly_the_names_the_python_rule_drops(tmp_path: Path) -> None:
    """launch/colossalai_run.sh has its own copy of the rule (in bash): it must name the same variables. A missing
    HOSTFILE ends it (exit 2) right after it dropped them, before anything starts."""
    (tmp_path / "cfg.yaml").write_text("model: {}\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HOSTFILE": "hosts", "MASTER_ADDR": "node1"}
    env["NPROC_PER_NODE"] = "1"
    env.update({name: "value" for name in SECRETS + HARMLESS})
    env.update({**LOGIN_VALUES, **PLAIN_URLS})
    argv = ["bash", str(REPO / "launch" / "colossalai_run.sh"), "cfg.yaml"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    line = next(line for line in done.stderr.splitlines() if line.startswith(PREFIX))
    dropped = set(line.removeprefix(PREFIX).split())
    assert dropped == set(unexportable(env)) == set(SECRETS) | set(LOGIN_VALUES)
