#!/usr/bin/env bash
# Issue 15, fifteenth session, third device call: the overhead benchmark alone, with the paired
# statistic and more blocks for the host-bound rows (eager, CPU), on the final tree.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check15c}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 200 python3 benchmarks/bench_record.py --eager-blocks 60 --cpu-blocks 80 --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md"
