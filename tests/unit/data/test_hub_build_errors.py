"""What the Hub and ``datasets`` answer that is not the network (from a read-and-run audit of Hub datasets).

Before: a Hub dataset ``datasets`` could not build (parquet shards of two schemas, one line of a JSON-lines file
that does not parse) ended ``prepare`` in an 80-95-line traceback, ``data.on_bad_record: skip`` or not; a Hub
that answered "no data file matches" (``DataFilesNotFoundError``, ``EmptyDatasetError``: both
``FileNotFoundError``) was reported as "cannot be reached", with advice to go offline. Reproduced against the
stand-in Hub by the audit; here each answer is fed to the code that maps it.
"""

from __future__ import annotations

import pytest
from datasets.data_files import EmptyDatasetError
from datasets.exceptions import DataFilesNotFoundError, DatasetGenerationError
from datasets.table import CastError

from coati_kto.config.hub import parse_hub_dataset
from coati_kto.data import hub
from coati_kto.errors import DataError

KEY = "data.train_files"
SHA = "313e0bd7078d" + "0" * 28


def _failing_build(cause: Exception):
    def load_dataset(*args, **kwargs):
        try:
            raise cause
        except Exception as err:
            raise DatasetGenerationError("An error occurred while generating the dataset") from err

    return load_dataset


def test_a_dataset_datasets_cannot_build_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    spec = parse_hub_dataset("hf://datasets/org/shards", KEY)
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    schemas = "Couldn't cast\nprompt: string\nsource: string\nto\n{'prompt': Value('string')}\nbecause column names don't match"
    monkeypatch.setattr(
        datasets,
        "load_dataset",
        _failing_build(CastError(schemas, table_column_names=[], requested_column_names=[])),
    )
    with pytest.raises(DataError) as info:
        hub.open_split(spec, SHA)
    assert str(info.value) == (
        f"{spec.source}: datasets cannot build the dataset at 313e0bd7078d (CastError: Couldn't cast because "
        "column names don't match); data.on_bad_record cannot skip inside a Hub dataset: fix its files, or read "
        "those that build (?data_files=...)"
    )
    parse_error = ValueError("JSON parse error: Missing a name for object member. in row 3")
    monkeypatch.setattr(datasets, "load_dataset", _failing_build(parse_error))
    with pytest.raises(DataError, match=r"\(ValueError: JSON parse error: Missing a name .* in row 3\)"):
        hub.open_split(spec, SHA)


@pytest.mark.parametrize(
    ("entry", "error", "said"),
    [
        (
            "hf://datasets/org/nested?data_files=*.jsonl",
            DataFilesNotFoundError("no match"),
            "matches data_files=*.jsonl",
        ),
        ("hf://datasets/org/cardonly", EmptyDatasetError("no data files"), "is a data file datasets reads"),
    ],
)
def test_a_hub_that_answers_no_data_file_is_not_unreachable(entry: str, error: Exception, said: str) -> None:
    spec = parse_hub_dataset(entry, KEY)
    message = str(hub._hub_error(error, spec, f"{KEY}: {entry}"))
    assert message == f"{KEY}: {entry}: no file of the dataset on the Hub {said} ({type(error).__name__})"
    assert "cannot be reached" not in message and "HF_HUB_OFFLINE" not in message
