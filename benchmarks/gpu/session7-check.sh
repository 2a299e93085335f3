#!/usr/bin/env bash
# Issue 15, seventh session's first device call on one H200 (under 600 s): which stream and event
# calls the side stream uses here; the host cost of the calls made before a step is queued
# (benchmarks/diag/prebody_prims.py); the host phases of a recorded step, graphs and eager; then
# the GPU suite in three lanes (benchmarks/gpu/session-drain-final.sh with SUITE_ONLY=1).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check7}; mkdir -p "$L"
python3 -c "from replay.record import staging as s; print('raw streams', s._RAW_STREAMS, 'event record', s._event_record_c, 'event wait', s._event_wait_c)" > "$L/paths.txt" 2>&1
timeout -k 5 120 python3 benchmarks/diag/prebody_prims.py --rounds 100 > "$L/prims.txt" 2>&1
{ timeout -k 5 80 python3 benchmarks/diag/host_phases.py --steps 150; timeout -k 5 80 python3 benchmarks/diag/host_phases.py --no-graphs --steps 100; } > "$L/host_phases.txt" 2>&1
OUT=$L/suite SUITE_ONLY=1 bash benchmarks/gpu/session-drain-final.sh > "$L/suite.txt" 2>&1
cat "$L/paths.txt" "$L/prims.txt" "$L/host_phases.txt" "$L/suite.txt"
