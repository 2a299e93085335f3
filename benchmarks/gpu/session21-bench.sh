#!/usr/bin/env bash
# Issue 15, twenty-first session, first device call: the overhead benchmark (bench_record.py --ab)
# on the tree as the session began (2a01a48: the first run of the benchmark since the sixteenth
# session; the recording path changed since only in the seventeenth to twentieth sessions' fixes).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check21b}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 ${BLIM:-330} python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md"
