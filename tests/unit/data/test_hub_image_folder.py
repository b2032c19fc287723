"""A Hub dataset in datasets' imagefolder layout (``train/metadata.jsonl`` naming ``file_names``, the images beside
it) loads its images: datasets hands them as the downloaded copies' paths, which the refusal of paths in Hub
datasets (a security audit: they read files of this machine) refused too, until its review. Through the
stand-in Hub, in a fresh process (huggingface_hub reads HF_ENDPOINT at import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import io, json, os
from PIL import Image
from coati_kto.testing.hub import StandInHub

def png(colour):
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, "PNG")
    return out.getvalue()

prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
rows = [
    {"file_names": [name], "prompt": prompt, "completion": [{"role": "assistant", "content": c}], "label": ok}
    for name, c, ok in (("a.png", "red", True), ("b.png", "blue", False))
]
with StandInHub() as hub:
    files = {"train/metadata.jsonl": "".join(json.dumps(r) + "\\n" for r in rows).encode()}
    files |= {"train/a.png": png((255, 0, 0)), "train/b.png": png((0, 0, 255))}
    hub.commit("dataset", "me/vl", files)
    os.environ.update(HF_ENDPOINT=hub.url, HF_HOME=os.environ["HOME_FOR_HF"], HF_HUB_DISABLE_XET="1")
    from coati_kto.data.files import load_records

    loaded = load_records(["hf://datasets/me/vl"], images=True)
    pixels = [Image.open(io.BytesIO(r.images[0])).getpixel((0, 0)) for r in loaded.records]
    print(json.dumps({"pixels": pixels, "skipped": len(loaded.skipped)}))
"""


def test_a_hub_imagefolder_datasets_images_load(tmp_path: Path) -> None:
    from helpers import env

    environ = {**env(), "HOME_FOR_HF": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    environ.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=environ, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == '{"pixels": [[255, 0, 0], [0, 0, 255]], "skipped": 0}'
