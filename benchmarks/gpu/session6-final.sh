#!/usr/bin/env bash
# Issue 15, sixth session's closing device call on one H200 (under 600 s): which stream and event
# calls the side stream uses here; host phases of the last commit (old_tree/, a `git archive`)
# and of the working tree, eager; then benchmarks/gpu/session-drain-final.sh (the GPU suite in
# three lanes, the writer, the overhead benchmark, the paired steps).
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/final6}; mkdir -p "$L"
here=$PWD
PYTHONPATH=$here python3 -c "from replay.record import staging as s; print('raw streams', s._RAW_STREAMS, 'event record', s._event_record_c, 'event wait', s._event_wait_c)" > "$L/paths.txt" 2>&1
hp() { (cd "$1" && PYTHONPATH=$PWD timeout 80 python3 benchmarks/diag/host_phases.py "${@:2}"); }
{ echo "== old eager"; hp "$here/old_tree" --no-graphs --steps 100; echo "== new eager"; hp "$here" --no-graphs --steps 100; } > "$L/ab-eager.txt" 2>&1
rm -rf "$here/old_tree"
OUT=$L bash benchmarks/gpu/session-drain-final.sh > "$L/console.txt" 2>&1
cat "$L/paths.txt"; grep -E "^==|until|end_step|Staging.stage|seal_job" "$L/ab-eager.txt"; cat "$L/console.txt"
