"""The README's opening: the two commands that work on a fresh CPU machine first, then the GPU install line and
`make gpu-check` (issue 50: the GPU lines had moved to docs/installing.md and docs/gpu.md, and a user with a GPU
read two CPU commands and nothing on installing for it). Every make target named there exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _opening_commands() -> list[str]:
    """The commands of the ```bash blocks above the README's description of the project ("coati-kto trains")."""
    opening = (REPO / "README.md").read_text().split("\ncoati-kto trains", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", opening, re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_the_readme_opens_with_the_cpu_commands_then_names_the_gpu_ones() -> None:
    assert _opening_commands() == [
        "make quickstart",
        "make test",
        "make install PROFILE=gpu",
        "make gpu-check",
    ]


def test_every_make_target_the_opening_names_is_in_the_makefile() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    assert {command.split()[1] for command in _opening_commands()} <= targets
    assert (REPO / "requirements" / "gpu.txt").is_file()  # PROFILE=gpu's requirements
