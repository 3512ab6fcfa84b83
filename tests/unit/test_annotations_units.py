"""Issue 27 item 4: every refusal of a GPU memory key says which unit that key
takes. The per-container ``.gpu-memory.request`` / ``.limit`` keys are
Kubernetes quantities in bytes (a bare ``40960`` is 40960 bytes); KAI's
pod-level ``gpu-memory`` is a whole number of MiB per GPU (``20Gi`` is no
whole number). Each message names the key, the value, the rule and the unit,
with the spelling the writer probably meant."""

from __future__ import annotations

import pytest

from fracplugin.annotations import parse
from fracplugin.model import FractionError

P = "nvidia.com/container."
REQ = f"{P}app.gpu-memory.request"
LIM = f"{P}app.gpu-memory.limit"
BYTES = "this key is a Kubernetes quantity in bytes (40Gi, 4096Mi, 42949672960)"
MIB = "gpu-memory is a whole number of MiB per GPU (KAI's pod-level form, e.g. 20480)"
GPUS = "gpu-fraction-num-devices is a whole number of GPUs (e.g. 2)"


def refusal(annotations: dict[str, str]) -> str:
    with pytest.raises(FractionError) as ei:
        parse(annotations, "app", containers=["app"])
    return ei.value.message


def test_a_bare_mib_number_in_a_quantity_key_is_bytes_and_the_message_says_so() -> None:
    assert refusal({REQ: "40960"}) == (
        f'{REQ}="40960" is below 1Mi: GPU memory must be at least 1Mi (1048576 bytes); {BYTES}; '
        "did you mean 40960Mi?")
    assert refusal({LIM: "512"}).endswith("; did you mean 512Mi?")


@pytest.mark.parametrize("raw,rule", [
    ("lots", "is not a Kubernetes quantity (examples: 40Gi, 4096M, 1.5G, 4294967296)"),
    ("-1Gi", "is negative: GPU memory must be at least 1Mi"),
    ("2Pi", "is absurdly large: GPU memory above 1Pi is refused"),
    ("100Ki", "is below 1Mi: GPU memory must be at least 1Mi (1048576 bytes)"),
    ("0", "is below 1Mi: GPU memory must be at least 1Mi (1048576 bytes)"),
])
def test_every_quantity_refusal_names_bytes_and_only_bare_positive_integers_get_the_mib_hint(raw: str, rule: str) -> None:
    # no "did you mean 0Mi?" for zero, nor for a value that is not a bare integer
    assert refusal({REQ: raw}) == f'{REQ}="{raw}" {rule}; {BYTES}'


def test_pod_level_gpu_memory_is_mib_and_a_quantity_there_gets_its_mib() -> None:
    assert refusal({"gpu-memory": "20Gi"}) == (
        f'gpu-memory="20Gi" is not a whole number; {MIB}; did you mean "20480" (MiB)?')
    assert refusal({"gpu-memory": "1.5G"}).endswith('; did you mean "1431" (MiB)?')  # rounded up, as the quantity keys
    # not a quantity of at least 1Mi: no guess
    assert refusal({"gpu-memory": "lots"}) == f'gpu-memory="lots" is not a whole number; {MIB}'
    assert refusal({"gpu-memory": "512Ki"}) == f'gpu-memory="512Ki" is not a whole number; {MIB}'
    assert refusal({"gpu-memory": "0"}) == f'gpu-memory="0" must be at least 1; {MIB}'
    assert refusal({"gpu-memory": "-5"}) == f'gpu-memory="-5" must be at least 1; {MIB}'
    assert refusal({"gpu-memory": "99999999999"}) == f'gpu-memory="99999999999" must be at most 1073741824; {MIB}'
    # and the right spelling is accepted, in MiB
    r = parse({"gpu-memory": "20480"}, "app", containers=["app"])
    assert r is not None and r.request.mib == 20480


def test_gpu_count_refusals_name_gpus() -> None:
    assert refusal({"gpu-memory": "20480", "gpu-fraction-num-devices": "two"}) == (
        f'gpu-fraction-num-devices="two" is not a whole number; {GPUS}')
    assert refusal({"gpu-memory": "20480", "gpu-fraction-num-devices": "65"}) == (
        f'gpu-fraction-num-devices="65" must be at most 64; {GPUS}')
