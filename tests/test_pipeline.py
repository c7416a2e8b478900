"""Pipeline parallelism's layer split (host code)."""

from __future__ import annotations

import pytest

from jaxserve.pipeline import stage_layers


@pytest.mark.parametrize(
    "layers, stages, counts",
    [(30, 1, [30]), (30, 2, [15, 15]), (30, 3, [10, 10, 10]), (30, 4, [8, 8, 7, 7]), (30, 5, [6] * 5), (7, 7, [1] * 7)],
)
def test_layers_split_as_evenly_as_possible(layers, stages, counts):
    split = stage_layers(layers, stages)
    assert [len(r) for r in split] == counts
    assert [i for r in split for i in r] == list(range(layers))  # contiguous, in order, each layer once


@pytest.mark.parametrize(("stages", "match"), [(31, "exceeds the model's 30 layers"), (0, "positive int")])
def test_bad_degrees_are_named(stages, match):
    with pytest.raises(ValueError, match=match):
        stage_layers(30, stages)
