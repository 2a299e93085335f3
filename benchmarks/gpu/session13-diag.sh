#!/usr/bin/env bash
# Issue 15, thirteenth session: where the eager CUDA step's recorder time goes (host phases,
# paired steps, the recorder's Python under cProfile). Development figures, not RESULTS.md's.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/diag13}; mkdir -p "$L"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; } > "$L/summary.txt" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.txt" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" >> "$L/summary.txt"; }
t host-phases-eager 120 python3 benchmarks/diag/host_phases.py --no-graphs --steps 200
t interleave-eager 150 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160
t pyprofile-eager 120 python3 benchmarks/diag/step_pyprofile.py --steps 150 --top 70
cat "$L/summary.txt"; for f in "$L"/*.txt; do echo "=== $f"; cat "$f"; done
