"""The docs name only what a clone holds: every repo path they name exists, every relative link resolves, and no
path points outside the repository (README once sent readers to ../shared/DESIGN.md and the drills' cluster
tools lived in ../shared/tools, neither of which a clone has)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Where the docs live, and the files that name scripts by path (the configs' and launch scripts' headers).
DOCS = [
    REPO / "README.md",
    REPO / "applications" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "tests" / "drills" / "tools" / "README.md",
]
# The changelog names paths as they were when a change landed, so only its links are checked.
LINKED = DOCS + [REPO / "CHANGELOG.md"]
NAMING = DOCS + [
    *sorted((REPO / "configs").glob("*.yaml")),
    *sorted((REPO / "launch").glob("*.sh")),
    REPO / "launch" / "slurm.sbatch",
]
NAMED = re.compile(
    r"(?<![\w./-])(?:launch|applications|configs|benchmarks|docs|tests|coati_kto|requirements)/[\w./-]*\w"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
UPWARD = re.compile(r"(?<![\w.])(?:\.\./)+[\w.-]+")
GONE = {"benchmarks/gpu_check.py"}  # docs/gpu.md says it was folded into gpu_bench.py and deleted


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_docs_pages_are_there() -> None:
    names = {p.name for p in (REPO / "docs").glob("*.md")}
    assert {
        "design.md",
        "architecture.md",
        "operations.md",
        "families.md",
        "performance.md",
        "gpu.md",
    } <= names


def test_every_repo_file_the_docs_name_exists() -> None:
    """The configs' launch lines and the docs name scripts by path: multinode_zero2.yaml's header named
    launch/colossalai_run_multinode.sh, which does not exist (the hostfile goes to colossalai_run.sh)."""
    missing = sorted(
        f"{_rel(doc)}: {path}"
        for doc in NAMING
        for path in set(NAMED.findall(doc.read_text()))
        if path not in GONE and not (REPO / path).exists()
    )
    assert missing == []


@pytest.mark.parametrize("doc", LINKED, ids=_rel)
def test_every_relative_link_resolves_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        resolved = (doc.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(REPO) or not resolved.exists():
            bad.append(target)
    assert bad == []


SCRATCH = ("/tmp/", "/var/tmp/")


@pytest.mark.parametrize("doc", NAMING, ids=_rel)
def test_no_path_points_outside_the_repository(doc: Path) -> None:
    """A `../x` path that climbs out of the repository from where the file lives, or an absolute path into the
    folder that holds the checkout, names something a clone does not have."""
    text = doc.read_text()
    outside = [p for p in UPWARD.findall(text) if not (doc.parent / p).resolve().is_relative_to(REPO)]
    # Scratch paths (/tmp/gpu_bench.json) name no sibling of the checkout, even for a clone that lives in /tmp.
    siblings = re.finditer(re.escape(str(REPO.parent).rstrip("/")) + r"/[\w./-]+", text)
    outside += [m.group(0) for m in siblings if not m.group(0).startswith(SCRATCH)]
    outside += re.findall(r"\.\./shared\b[\w./-]*", text)  # the workshop's sibling folder, from any depth
    assert outside == []
