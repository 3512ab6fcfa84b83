"""The ledger's record encoder is json.dumps(sort_keys, compact), written
field by field (issue 14): the two stay identical, any text included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from fracplugin.ledgerstore import encode_tenancy
from fracplugin.model import ComputeMode, Tenancy

TEXT = st.text(max_size=12)  # any code point: quotes, backslashes, controls, non-ASCII, surrogates
INTS = st.integers(min_value=-(2**70), max_value=2**70)


@settings(max_examples=500, deadline=None)
@given(TEXT, TEXT, TEXT, TEXT, TEXT, INTS, INTS, st.sampled_from(list(ComputeMode)), TEXT,
       st.one_of(st.none(), TEXT), st.one_of(st.none(), INTS), TEXT, TEXT, st.one_of(st.just(0), INTS))
def test_same_text_as_json_dumps(uid, ns, name, ctr, gpu, req, lim, mode, cid, mpsns, atp, door, res, held):
    t = Tenancy(uid, ns, name, ctr, gpu, req, lim, mode, cid, mpsns, atp, door, res, held)
    want = json.dumps(t.to_dict(), sort_keys=True, separators=(",", ":"))
    assert encode_tenancy(t) == want


def test_a_non_integer_mib_is_refused():
    t = Tenancy("u", "ns", "p", "app", "GPU-1", True, 2, ComputeMode.TIME_SLICING)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_tenancy(t)
