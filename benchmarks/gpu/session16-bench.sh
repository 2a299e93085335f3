#!/usr/bin/env bash
# Issue 15, sixteenth session, first device call: the overhead benchmark (bench_record.py --ab,
# with the settled blocks and the drain's CPU a step), then the drain's CPU a recorded step on
# this host for the tree before this session (_old_tree/, c5a813c, copied in for this call only)
# and this one, alternately.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check16}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; git log --oneline -1; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 300 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
D="$L/drain_cpu.txt"
for args in "--device cuda --preset small --graphs" "--device cpu --preset tiny"; do
  for tree in old new; do
    p=$PWD; [ $tree = old ] && p=$PWD/_old_tree
    echo "== $tree tree: drain_cpu.py $args --steps 600 --rounds 2" >> "$D"
    PYTHONPATH=$p timeout -k 5 60 python3 benchmarks/diag/drain_cpu.py $args --steps 600 --rounds 2 >> "$D" 2>&1
    echo "rc=$? drain_cpu $tree $args" | tee -a "$S"
  done
done
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md" "$D"
