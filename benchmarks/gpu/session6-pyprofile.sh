#!/usr/bin/env bash
# Issue 15, sixth session: where the recorder's host Python goes in an eager and a graph CUDA step.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/pyprof}; mkdir -p "$L"
timeout 120 python3 benchmarks/diag/step_pyprofile.py --top 70 > "$L/pyprofile-eager.txt" 2>&1
timeout 120 python3 benchmarks/diag/step_pyprofile.py --graphs --top 40 > "$L/pyprofile-graphs.txt" 2>&1
cat "$L"/pyprofile-*.txt
