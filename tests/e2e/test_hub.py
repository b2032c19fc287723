"""From the Hub and back, through the real CLI against a stand-in Hub on the loopback (coati_kto.testing.hub),
never the network: a Hub dataset is prepared at the commit its revision names (a new commit rebuilds, an
unchanged one does not, HF_HUB_OFFLINE reads the caches without a request); its mistakes are one line each
before anything heavy; a 2-process run trained on it uploads final/ byte for byte, a failed upload says how to
retry and the retry uploads; the token is never printed or written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import env, preference_records
from safetensors.torch import load_file

from coati_kto.testing.hub import StandInHub

TOKEN = "hf_standInSecret0123456789"  # distinctive: grepped for in every output


def jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[StandInHub]:
    with StandInHub(token=TOKEN) as server:
        yield server
    assert server.unhandled == []  # every call the clients made is one the stand-in serves


def hub_env(hub: StandInHub, root: Path, token: bool = False, offline: bool = False) -> dict[str, str]:
    out = {k: v for k, v in env().items() if k not in ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_TOKEN_PATH")}
    out.update(HF_ENDPOINT=hub.url, HF_HOME=str(root / "hf-home"), HF_HUB_DISABLE_XET="1")
    out.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_UPDATE_CHECK="1")
    return {**out, **({"HF_TOKEN": TOKEN} if token else {}), **({"HF_HUB_OFFLINE": "1"} if offline else {})}


def run(args: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "coati_kto", *args]
    return subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=600)


def write_config(root: Path, model_dir: Path, extra: str = "") -> Path:
    path = root / "config.yaml"
    path.write_text(
        f"""
model:
  path: {model_dir}
data:
  train_files: hf://datasets/org/feedback
  eval_files: hf://datasets/org/feedback
  prepared_dir: {root / "prepared"}
  max_length: 64
train:
  micro_batch_size: 2
  max_steps: 2
  lr: 1.0e-3
plugin:
  name: ddp
output:
  dir: {root / "out"}
{extra}"""
    )
    return path


def test_a_hub_dataset_is_prepared_at_its_commit_and_offline_from_the_cache(
    hub: StandInHub, tmp_path: Path, tiny_model_dir: Path
) -> None:
    first = hub.commit(
        "dataset",
        "org/feedback",
        {
            "data/train.jsonl": jsonl(preference_records(24, 0)),
            "data/test.jsonl": jsonl(preference_records(9, 100)),
        },
    )
    config, environ = write_config(tmp_path, tiny_model_dir), hub_env(hub, tmp_path)
    built = run(["prepare", str(config)], environ)
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.startswith(f"prepared {tmp_path / 'prepared'} (no prepared data yet)")
    stats = json.loads((tmp_path / "prepared" / "stats.json").read_text())
    assert stats["files"] == {  # the commit it was read at, not "main"
        "train": [f"hf://datasets/org/feedback?split=train&revision={first}"],
        "eval": [f"hf://datasets/org/feedback?split=test&revision={first}"],
    }
    assert (stats["train"]["examples"], stats["eval"]["examples"]) == (24, 9)
    assert run(["prepare", str(config)], environ).stdout.startswith(f"reusing {tmp_path / 'prepared'}")

    second = hub.commit("dataset", "org/feedback", {"data/train.jsonl": jsonl(preference_records(30, 0))})
    rebuilt = run(["prepare", str(config)], environ)
    spec = "hf://datasets/org/feedback?split=train&revision=main"
    assert f"changed: train_files (revision of {spec}: {first[:12]} -> {second[:12]})" in rebuilt.stdout
    assert json.loads((tmp_path / "prepared" / "stats.json").read_text())["train"]["examples"] == 30

    asked = len(hub.requests)
    offline = hub_env(hub, tmp_path, offline=True)
    assert run(["prepare", str(config)], offline).stdout.startswith(f"reusing {tmp_path / 'prepared'}")
    changed = run(["prepare", str(config), "data.max_length=80"], offline)  # rebuilt from the datasets cache
    assert changed.stdout.startswith(
        f"prepared {tmp_path / 'prepared'} (changed: max_length, max_prompt_length)"
    )
    assert json.loads((tmp_path / "prepared" / "stats.json").read_text())["train"]["examples"] == 30
    pinned = run(
        ["prepare", str(config), f"data.train_files=hf://datasets/org/feedback?revision={first}"], offline
    )
    assert json.loads((tmp_path / "prepared" / "stats.json").read_text())["train"]["examples"] == 24, (
        pinned.stderr
    )
    assert len(hub.requests) == asked  # offline: not one request


def test_hf_download_then_train_offline_with_no_datasets_cache(
    hub: StandInHub, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """docs/usage.md's offline recipe as printed: `hf download --repo-type dataset OWNER/NAME` where the Hub is
    reached, then `train` under HF_HUB_OFFLINE=1 from that cache alone (no HF_HOME/datasets). Before: "revision
    main is not in the Hugging Face cache and HF_HUB_OFFLINE is set", for it and for a dataset cached nowhere."""
    sha = hub.commit(
        "dataset",
        "org/feedback",
        {
            "data/train.jsonl": jsonl(preference_records(24, 0)),
            "data/test.jsonl": jsonl(preference_records(9, 100)),
        },
    )
    hf = [str(Path(sys.executable).parent / "hf"), "download", "--repo-type", "dataset", "org/feedback"]
    got = subprocess.run(hf, env=hub_env(hub, tmp_path), capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    cache = tmp_path / "hf-home" / "hub"
    assert (cache / "datasets--org--feedback" / "refs" / "main").read_text() == sha
    assert not (tmp_path / "hf-home" / "datasets").exists()

    config, environ, asked = (
        write_config(tmp_path, tiny_model_dir),
        hub_env(hub, tmp_path, offline=True),
        len(hub.requests),
    )
    missing = run(["train", str(config), "data.eval_files=hf://datasets/org/elsewhere"], environ)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"error: data.eval_files: hf://datasets/org/elsewhere?split=test&revision=main: not in the Hugging Face "
        f"cache ({cache}) and HF_HUB_OFFLINE is set: fill it with `hf download --repo-type dataset org/elsewhere` "
        "where the Hub can be reached"
    ]
    trained = run(["train", str(config)], environ)
    assert trained.returncode == 0, trained.stderr[-3000:]
    stats = json.loads((tmp_path / "prepared" / "stats.json").read_text())
    assert stats["files"] == {
        "train": [f"hf://datasets/org/feedback?split=train&revision={sha}"],
        "eval": [f"hf://datasets/org/feedback?split=test&revision={sha}"],
    }
    assert (stats["train"]["examples"], stats["eval"]["examples"]) == (24, 9)
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()
    assert len(hub.requests) == asked  # offline: not one request


CHECK = """
import sys
from coati_kto.config.hub import parse_hub_dataset
from coati_kto.data.hub import check
from coati_kto.errors import DataError
for value in sys.argv[1:]:
    try:
        print(check(parse_hub_dataset(value, "data.train_files"), "data.train_files"))
    except DataError as err:
        print(err)
"""


def test_hub_dataset_mistakes_are_one_line_each(
    hub: StandInHub, tmp_path: Path, tiny_model_dir: Path
) -> None:
    files = {"data/train.jsonl": jsonl(preference_records(12, 0))}
    public = hub.commit("dataset", "org/feedback", files)
    hub.commit("dataset", "org/private", files, private=True)
    hub.commit("dataset", "org/gated", {"README.md": b"---\nlicense: mit\n---\n", **files}, gated=True)
    card = b"---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/*.jsonl\n---\n"
    hub.commit("dataset", "org/configs", {"README.md": card, "en/a.jsonl": files["data/train.jsonl"]})
    values = [
        "hf://datasets/org/feedback",
        "hf://datasets/org/missing",
        "hf://datasets/org/private",
        "hf://datasets/org/gated",
        "hf://datasets/org/feedback?revision=v9",
        "hf://datasets/org/feedback?split=validation",
        "hf://datasets/org/configs?config=fr",
        "hf://datasets/org/feedback?data_files=data/*.jsonl",
        "hf://datasets/org/feedback?data_files=data/*.csv",
    ]
    no_token = subprocess.run(
        [sys.executable, "-c", CHECK, *values], env=hub_env(hub, tmp_path), capture_output=True, text=True
    )
    login = "HF_TOKEN, or `hf auth login`"
    where = "data.train_files: hf://datasets/org"
    assert no_token.stdout.splitlines() == [
        public,
        f"{where}/missing?split=train&revision=main: no such dataset on the Hub ({hub.url}), or it is private or "
        f"gated and no token is set ({login})",
        f"{where}/private?split=train&revision=main: no such dataset on the Hub ({hub.url}), or it is private or "
        f"gated and no token is set ({login})",
        f"{where}/gated?split=train&revision=main: the dataset is gated on the Hub and no token is set ({login}): "
        "ask for access on its page",
        f"{where}/feedback?split=train&revision=v9: the dataset has no revision v9 on the Hub",
        f"{where}/feedback?split=validation&revision=main: no split validation (its splits: train)",
        f"{where}/configs?config=fr&split=train&revision=main: BuilderConfig 'fr' not found. Available: ['en']",
        public,
        f"{where}/feedback?data_files=data/*.csv&split=train&revision=main: no file of the dataset at "
        f"{public[:12]} matches data_files=data/*.csv",
    ], no_token.stderr[-2000:]
    with_token = subprocess.run(
        [sys.executable, "-c", CHECK, *values[:4]],
        env=hub_env(hub, tmp_path, token=True),
        capture_output=True,
        text=True,
    )
    assert with_token.stdout.splitlines()[1:] == [
        f"{where}/missing?split=train&revision=main: no such dataset on the Hub ({hub.url}), or your token cannot "
        "read it",
        hub.repos[("dataset", "org/private")].branches["main"],
        hub.repos[("dataset", "org/gated")].branches["main"],
    ]
    assert TOKEN not in with_token.stdout + with_token.stderr

    # Through `train`: every problem at once, one line each, before anything heavy (no output.dir made).
    config = write_config(tmp_path, tiny_model_dir, "  push_to_hub: me/kto-tiny\n")
    refused = run(
        ["train", str(config), "data.train_files=hf://datasets/org/feedback?split=validation"],
        hub_env(hub, tmp_path),
    )
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"error: {where}/feedback?split=validation&revision=main: no split validation (its splits: train)",
        "data.eval_files: hf://datasets/org/feedback?split=test&revision=main: no split test (its splits: train)",
        "output.push_to_hub me/kto-tiny: no Hugging Face token (set HF_TOKEN, or run `hf auth login`): the upload "
        "at the end of the run would fail",
    ]
    assert not (tmp_path / "out").exists() and not (tmp_path / "prepared").exists()


def tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_a_run_on_hub_data_pushes_final_and_a_failed_push_is_retried(
    hub: StandInHub, tmp_path: Path, tiny_model_dir: Path
) -> None:
    hub.commit(
        "dataset",
        "org/feedback",
        {
            "data/train.jsonl": jsonl(preference_records(24, 0)),
            "data/test.jsonl": jsonl(preference_records(9, 100)),
        },
    )
    config = write_config(tmp_path, tiny_model_dir, "  push_to_hub: {repo_id: me/kto-tiny}\n")
    environ, final = hub_env(hub, tmp_path, token=True), tmp_path / "out" / "final"
    trained = run(["train", str(config), "--nproc-per-node", "2"], environ)
    assert trained.returncode == 0, trained.stderr[-3000:]
    sha = hub.repos[("model", "me/kto-tiny")].branches["main"]
    assert f"pushed {final} to me/kto-tiny: commit {sha[:12]}" in trained.stdout
    local, uploaded = tree(final), hub.files("model", "me/kto-tiny")
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= set(local)
    assert uploaded == {**local, ".gitattributes": uploaded[".gitattributes"]}  # byte for byte
    assert "datasets:\n- org/feedback\n" in local["README.md"].decode()
    assert hub.repos[("model", "me/kto-tiny")].private

    hub.fail_commits = 1  # the Hub fails the next commit: the files stay, the line says how to retry
    failed = run(["export", str(config), "--push", "output.push_to_hub.revision=dev"], environ)
    assert failed.returncode == 3
    assert failed.stdout.splitlines()[-1] == (
        f"output.push_to_hub: uploading {final} to me/kto-tiny (branch dev) on {hub.url} failed (HfHubHTTPError: "
        f"Server error '500 Internal Server Error' for url '{hub.url}/api/models/me/kto-tiny/commit/dev'); "
        "everything is on disk: retry with `coati-kto export CONFIG --push`"
    )
    assert tree(final) == local
    retried = run(["export", str(config), "--push", "output.push_to_hub.revision=dev"], environ)
    assert retried.returncode == 0, retried.stdout[-2000:] + retried.stderr[-2000:]
    assert hub.files("model", "me/kto-tiny", "dev") == uploaded

    outputs = [trained.stdout, trained.stderr, failed.stdout, failed.stderr, retried.stdout, retried.stderr]
    assert not [text for text in outputs if TOKEN in text]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "hf-home" not in p.parts]
    assert not [p for p in written if TOKEN.encode() in p.read_bytes()]


def test_checkpoints_go_to_branches_in_the_background_and_resume_from_a_download(
    hub: StandInHub, tmp_path: Path, tiny_model_dir: Path
) -> None:
    hub.commit("dataset", "org/feedback", {"data/train.jsonl": jsonl(preference_records(24, 0))})
    push = "  push_to_hub: {repo_id: me/kto-ckpt, checkpoints: true}\n  save_interval: 2\n  keep_last: 1\n"
    config = write_config(tmp_path, tiny_model_dir, push)
    environ, checkpoints = hub_env(hub, tmp_path, token=True), tmp_path / "out" / "checkpoints"
    hub.fail_branches = {"step-4"}  # step-4's upload fails: one line, the run goes on; final/ goes up
    overrides = ["data.eval_files=[]", "train.max_steps=4"]
    trained = run(["train", str(config), *overrides], environ)
    # trained, saved and final/ pushed, but a checkpoint is missing from the Hub: exit 3 (it was 0)
    assert trained.returncode == 3, trained.stderr[-3000:]
    assert f"pushed {tmp_path / 'out' / 'final'} to me/kto-ckpt: commit " in trained.stdout
    assert trained.stdout.splitlines()[-1].startswith(
        "output.push_to_hub.checkpoints: not every checkpoint went up"
    )
    step2, step4 = checkpoints / "step-2", checkpoints / "step-4"
    sha = hub.repos[("model", "me/kto-ckpt")].branches["step-2"]
    retry = f"hf upload me/kto-ckpt {step4} --revision step-4"
    assert f"pushed {step2} to me/kto-ckpt (branch step-2): commit {sha[:12]}" in trained.stdout
    assert (
        f"output.push_to_hub: uploading {step4} to me/kto-ckpt (branch step-4) on {hub.url} failed (HfHubHTTPError: "
        f"Server error '500 Internal Server Error' for url '{hub.url}/api/models/me/kto-ckpt/commit/step-4'); the "
        f"run goes on; to retry while output.keep_last keeps the checkpoint: `{retry}`"
    ) in trained.stdout.splitlines()
    assert not step2.exists() and not (tmp_path / "out" / ".hub_uploads").exists()  # pruned; staging gone
    assert hub.files("model", "me/kto-ckpt", "step-2")["COMPLETE"] == b"step 2\n"  # uploaded before pruned

    hub.fail_branches = set()  # the printed retry line works as printed
    hf = [str(Path(sys.executable).parent / "hf"), *retry.split()[1:]]
    retried = subprocess.run(hf, env=environ, capture_output=True, text=True, timeout=300)
    assert retried.returncode == 0, retried.stderr[-2000:]
    uploaded = hub.files("model", "me/kto-ckpt", "step-4")
    assert uploaded == {**tree(step4), ".gitattributes": uploaded[".gitattributes"]}  # byte for byte
    assert {"COMPLETE", "meta.json", "lr_scheduler.pt", "model/model-00001.safetensors"} <= set(uploaded)

    download = tmp_path / "downloaded-step-2"  # what a user resumes from: the branch, downloaded
    fetch = "import sys, huggingface_hub as h; h.snapshot_download('me/kto-ckpt', revision='step-2', local_dir=sys.argv[1])"
    got = subprocess.run(
        [sys.executable, "-c", fetch, str(download)], env=environ, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-2000:]
    resumed_out = tmp_path / "resumed"
    resumed = run(
        ["train", str(config), *overrides, f"train.resume={download}", f"output.dir={resumed_out}"], environ
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = load_file(tmp_path / "out" / "final" / "model.safetensors")
    after = load_file(resumed_out / "final" / "model.safetensors")
    assert whole.keys() == after.keys() and all(torch.equal(whole[k], after[k]) for k in whole)
    assert TOKEN not in trained.stdout + trained.stderr + resumed.stdout + resumed.stderr
