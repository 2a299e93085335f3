#!/usr/bin/env bash
# Issue 15, fourteenth session, last device call (little device time left): the overhead
# benchmark alone (bench_record.py --ab) on the tree whose GPU suite passed in session14-b.sh.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check14c}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 170 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md"
