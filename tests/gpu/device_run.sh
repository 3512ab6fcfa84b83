#!/usr/bin/env bash
# `make gpu-check` in one call of the project's device tool (docs/gpu-check.md):
#   run(carry=["tests/gpu/wheels"], timeout_s=420, command="bash tests/gpu/device_run.sh")
# Brings back, under $OUT: gpu-check.json, gpu-check.log (the console) and logs/ (the
# daemon's log and up to five MPS logs): eight files at most, the tool's limit.
# Elsewhere $OUT is unset and everything goes to ./gpu-check-out/.
set -u
out="${OUT:-./gpu-check-out}"
mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1
[ -d tests/gpu/wheels ] || echo "note: tests/gpu/wheels is missing (make gpu-check-wheels here, then carry it)"
if command -v make >/dev/null; then
    make gpu-check GPU_CHECK_ARGS="--artifacts $out/logs" 2>&1 | tee "$out/gpu-check.log"
else
    python3 tests/gpu/gpu_check.py --out gpu-check.json --artifacts "$out/logs" 2>&1 | tee "$out/gpu-check.log"
fi
rc=${PIPESTATUS[0]}
cp gpu-check.json "$out/" 2>/dev/null
exit "$rc"
