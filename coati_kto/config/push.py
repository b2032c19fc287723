"""``output.push_to_hub``: where the end of a run (or ``coati-kto export --push``) uploads ``final/``."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from coati_kto.config.hub import HUB_ID
from coati_kto.config.section import Section


class PushToHubSection(Section):
    """A Hub model repo; the token comes from HF_TOKEN or ``hf auth login``'s file, never from the config."""

    repo_id: str = Field(
        description="OWNER/NAME of the model repo (created if missing), as TRL's --hub_model_id."
    )
    private: bool = Field(
        True, description="Create the repo private (an existing repo keeps its visibility)."
    )
    revision: str = Field("main", description="Branch to commit to (created from main if missing).")
    checkpoints: bool = Field(
        False,
        description="Also upload each complete checkpoint (model, optimizer and trainer state: resumable after "
        "`hf download REPO --revision step-N --local-dir DIR` with train.resume=DIR) to a branch named as its "
        "directory, step-N; in the background on global rank 0, one at a time; the run waits for them at its end.",
    )

    @model_validator(mode="before")
    @classmethod
    def _repo_id_alone(cls, data: Any) -> Any:
        return {"repo_id": data} if isinstance(data, str) else data  # push_to_hub: org/name

    @field_validator("repo_id")
    @classmethod
    def _owner_and_name(cls, value: str) -> str:
        if "/" not in value or HUB_ID.fullmatch(value) is None:
            raise ValueError(f"{value!r} is no Hub repo id (OWNER/NAME)")
        return value
