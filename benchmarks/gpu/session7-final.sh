#!/usr/bin/env bash
# Issue 15, seventh session's closing device call on one H200 (under 600 s): the host phases of a
# CUDA-graph step before and after the session's changes to the path before the call (old_tree/:
# `git archive` of the last commit before them; alternating, twice), then the GPU suite in three
# lanes, the overhead benchmark and the paired steps (benchmarks/gpu/session-drain-final.sh,
# without its writer-only runs: the writer's rows are in the benchmark).
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/final7}; mkdir -p "$L"
here=$PWD
hp() { (cd "$1" && PYTHONPATH=$PWD timeout -k 5 70 python3 benchmarks/diag/host_phases.py "${@:2}"); }
{ for i in 1 2; do echo "== old graphs $i"; hp "$here/old_tree" --steps 150; echo "== new graphs $i"; hp "$here" --steps 150; done; } > "$L/ab-graphs.txt" 2>&1
rm -rf "$here/old_tree"
export PYTHONPATH=$here
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
OUT=$L/suite SUITE_ONLY=1 bash benchmarks/gpu/session-drain-final.sh > "$L/suite.txt" 2>&1
s=$(date +%s)
timeout -k 5 200 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
s=$(date +%s)
{ timeout -k 5 60 python3 benchmarks/diag/interleave.py --no-graphs; timeout -k 5 60 python3 benchmarks/diag/interleave.py --device cpu; } > "$L/interleave.txt" 2>&1
echo "rc=$? interleave $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
grep -E "^==|until the body|Session._early_step|Recorder.begin_step|capture_rng" "$L/ab-graphs.txt"
cat "$L/suite.txt" "$S" "$L/bench_record.md" "$L/interleave.txt"
