#!/usr/bin/env bash
# The demo tests under CPU starvation: tests/component/test_demo.py N times in a
# row while busy-loop processes keep the cores busy beside them (issue 15: "the
# demo tests pass 20 runs in a row while a CPU-bound load keeps both cores
# busy"; the crash it hunts was the demo's daemon aborting at start under load).
#
#   bash scripts/demo-soak.sh [N]      N runs (default 20)
#
# Environment: SOAK_LOAD (busy-loop processes, default: the number of CPUs,
# `nproc`), PY (default .venv/bin/python). Output: one line per run
# ("run 3/20: pass 41.2 s"), then "demo soak: P/N passed, W s wall, L busy
# loops"; the pytest output of a failed run is kept in build/demo-soak/run-K.log.
# Exit status 0 when every run passed, 1 otherwise. The busy loops are this
# script's own children, stopped by pid on exit (also on Ctrl-C).
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:-20}"
PY="${PY:-.venv/bin/python}"
LOAD="${SOAK_LOAD:-$(nproc)}"
LOGDIR=build/demo-soak
mkdir -p "$LOGDIR"

loads=()
stop_load() {
  for pid in "${loads[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${loads[@]}"; do wait "$pid" 2>/dev/null; done
  loads=()
}
trap stop_load EXIT
trap 'stop_load; exit 130' INT TERM

for _ in $(seq "$LOAD"); do
  "$PY" -c 'while True: pass' &
  loads+=("$!")
done

pass=0
t0=$(date +%s.%N)
for i in $(seq "$N"); do
  r0=$(date +%s.%N)
  if "$PY" -m pytest tests/component/test_demo.py -q -p no:cacheprovider >"$LOGDIR/run-$i.log" 2>&1; then
    pass=$((pass + 1)); verdict=pass; rm -f "$LOGDIR/run-$i.log"
  else
    verdict="FAIL (log: $LOGDIR/run-$i.log)"
  fi
  printf 'run %d/%d: %s %.1f s\n' "$i" "$N" "$verdict" "$(awk -v a="$r0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')"
done
wall=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')
stop_load
printf 'demo soak: %d/%d passed, %.0f s wall, %d busy loops\n' "$pass" "$N" "$wall" "$LOAD"
[[ "$pass" == "$N" ]]
