#!/usr/bin/env bash
# Issue 15, fourteenth session, first device call: the tree of a08fb70 (commit words by the
# driver's stream write) through the lane the thirteenth session's last call could not finish
# (HF + bisect GPU tests), then the overhead benchmark (bench_record.py --ab) and paired eager
# steps with the commit by stream write and by a device counter (interleave.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check14a}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short)
t lane-hf-bisect 240 "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py
s=$(date +%s)
timeout -k 5 170 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
t interleave-eager 90 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160
date -u +%FT%TZ >> "$S"
grep -E "^FAILED|^ERROR" "$L"/lane-*.log; tail -2 "$L"/lane-*.log
cat "$S" "$L/bench_record.md" "$L"/interleave-*.log
