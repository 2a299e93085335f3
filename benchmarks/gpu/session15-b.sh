#!/usr/bin/env bash
# Issue 15, fifteenth session, second device call: the overhead benchmark with the paired
# statistic (more blocks for the host-bound rows), and paired steps of the tree before this
# session (05f93b8, its replay/ in _old_tree) and this one, alternately, on the same host.
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check15b}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } > "$S" 2>&1
s=$(date +%s)
PYTHONPATH=$PWD timeout -k 5 280 python3 benchmarks/bench_record.py --ab --eager-blocks 60 --cpu-blocks 80 --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
for i in 1 2; do
  for tree in old new; do
    if [ $tree = old ]; then P=$PWD/_old_tree; else P=$PWD; fi
    echo "== $tree cpu" >> "$L/interleave-old-new.log"
    PYTHONPATH=$P timeout 60 python3 benchmarks/diag/interleave.py --device cpu --preset tiny --pairs 400 --only recorded 2>&1 | grep "recorded  \|error" >> "$L/interleave-old-new.log"
    echo "== $tree eager" >> "$L/interleave-old-new.log"
    PYTHONPATH=$P timeout 60 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160 --only recorded 2>&1 | grep "recorded  \|error" >> "$L/interleave-old-new.log"
  done
done
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md" "$L/interleave-old-new.log"
