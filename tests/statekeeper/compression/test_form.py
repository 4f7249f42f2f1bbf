"""The blob meta as a typed, versioned record (compression/form.py): what writers write reads back equal,
blobs written before the version read as they always did, and meta that describes nothing readable is
refused with ValueError (the loader then recomputes from the history)."""

import pytest

from statekeeper.compression import StoredForm


def test_every_kind_round_trips_through_its_meta():
    forms = [StoredForm(), StoredForm(bias=True), StoredForm("heads", "heads", {"codec": "int4", "tensors": {}}, num_tokens=9),
             StoredForm("sharing", "krul", pairs=((2, 3),), parts=(1,)),
             StoredForm("shared_heads", "minicache/expected@0.5", num_tokens=4, pairs=((0, 1),), parts=("v",))]
    for form in forms:
        assert StoredForm.from_meta(form.to_meta()) == form and form.to_meta()["form"] == 1


@pytest.mark.parametrize("legacy, kind", [
    ({}, "exact"), ({"bias": True}, "exact"), ({"method": "heads", "heads": True, "num_tokens": 5}, "heads"),
    ({"method": "krul", "pairs": [[1, 2]], "parts": [1]}, "sharing"),
    ({"heads": True, "num_tokens": 5, "pairs": [[0, 1]], "parts": ["k"], "quant": {"codec": "int8", "tensors": {}}},
     "shared_heads"),
])
def test_blobs_from_before_the_version_read_as_their_keys_say(legacy, kind):
    form = StoredForm.from_meta(legacy)
    assert form.kind == kind and form.version == 0 and form.codec == legacy.get("quant")
    assert form.is_compressed == (kind != "exact" or "quant" in legacy)


@pytest.mark.parametrize("meta", [
    {"form": 2, "kind": "exact"},  # a version this service does not know
    {"form": 1, "kind": "tape"},  # no method restores it
    {"form": 1, "kind": "heads"},  # without the length its rows scatter into
    {"form": 1, "kind": "heads", "num_tokens": -1},
    {"form": 1, "kind": "sharing", "pairs": [[0, 1, 2]], "parts": [1]},
    {"form": 1, "kind": "sharing", "pairs": [[0, "x"]], "parts": [1]},
    {"form": 1, "kind": "sharing", "pairs": [[0, 1]], "parts": [5]},  # shares what a layer does not have
    {"form": 1, "kind": "sharing", "pairs": 7},
    {"form": 1, "kind": "exact", "quant": "int8"},
    [],
])
def test_meta_that_describes_nothing_readable_is_refused(meta):
    with pytest.raises(ValueError):
        StoredForm.from_meta(meta)
