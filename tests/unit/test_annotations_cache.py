"""annotations.parse answers from a cache keyed by the values it reads
(issue 14): the cached answer is always the uncached one, refusals included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from fracplugin import annotations as ann
from fracplugin.model import FractionError

P = ann.DEFAULT_PREFIX
KEYS = [*ann.relevant_keys(P, "app"), *ann.relevant_keys(P, "side"), "unrelated/key"]
VALUES = st.sampled_from(["1Gi", "2Gi", "0.5", "0.25", "1", "2", "sm-sharing", "time-slicing", "0,1", "all", "",
                          " 1Gi", "app", "side", "4096", "x", "1.0", "0"])


def outcome(fn, *args, **kw):
    try:
        return ("ok", fn(*args, **kw))
    except FractionError as err:
        return ("refused", err.key, err.value, err.reason, err.code)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6), st.sampled_from(["app", "side"]),
       st.one_of(st.none(), st.just(["app", "side"]), st.just(["side", "app"])))
def test_cached_answer_is_the_uncached_one(annotations, container, containers):
    want = outcome(ann.parse_uncached, annotations, container, prefix=P, containers=containers)
    assert outcome(ann.parse, annotations, container, prefix=P, containers=containers) == want
    assert outcome(ann.parse, annotations, container, prefix=P, containers=containers) == want  # now cached


def test_unrelated_annotations_share_one_entry_and_related_ones_do_not():
    ann._parse_values.cache_clear()
    base = {P + "app.gpu-memory.request": "1Gi"}
    first = ann.parse({**base, "a": "1"}, "app")
    assert ann.parse({**base, "b": "2"}, "app") is first  # same relevant values: one parse
    other = ann.parse({**base, P + "app.gpu-memory.limit": "2Gi"}, "app")
    assert other is not None and first is not None
    assert (first.limit.mib, other.limit.mib) == (1024, 2048)
    assert ann._parse_values.cache_info().misses == 2


def test_refusal_is_raised_every_time():
    bad = {P + "app.gpu-memory.request": "lots"}
    for _ in range(2):
        with pytest.raises(FractionError) as e:
            ann.parse(bad, "app")
        assert (e.value.key, e.value.value, e.value.code) == (P + "app.gpu-memory.request", "lots", "quantity")


def test_long_values_are_parsed_without_the_cache():
    ann._parse_values.cache_clear()
    devices = ",".join(f"GPU-{i:040d}" for i in range(40))  # > PARSE_CACHE_MAX_CHARS
    assert len(devices) > ann.PARSE_CACHE_MAX_CHARS
    r = ann.parse({P + "app.gpu-memory.request": "1Gi", P + "app.gpus.devices": devices}, "app")
    assert r is not None and len(r.devices) == 40
    assert ann._parse_values.cache_info().currsize == 0
