#!/usr/bin/env bash
# The short closing call of issue 15's fourth session on one H200 (little device time left): the
# recorder's GPU tests and the drain process's tests, the full-logits writer with either drain,
# then the overhead benchmark; five files under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/gpu-last}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/test_record_gpu.py tests/test_drain_process.py > "$L/tests.log" 2>&1
echo "rc=$? tests $(( $(date +%s) - s ))s" | tee -a "$S"
s=$(date +%s)
{ timeout -k 5 60 python3 benchmarks/diag/interleave.py --writer; timeout -k 5 60 python3 benchmarks/diag/interleave.py --writer --drain thread; } > "$L/writer.txt" 2>&1
echo "rc=$? writer $(( $(date +%s) - s ))s" | tee -a "$S"
s=$(date +%s)
timeout -k 5 170 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
tail -3 "$L/tests.log"; grep -v "^  host:" "$L/writer.txt"; cat "$L/bench_record.md"
