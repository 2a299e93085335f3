#!/usr/bin/env bash
# One device call for the drain process (issue 15, fourth session) on one H200: the recorder's
# GPU tests (the SIGKILL tests of the ring with either drain among them) and the drain process's
# own tests, then where a recorded step's time goes (plain and recorded steps interleaved), then
# the overhead benchmark, under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/gpu-drain}; mkdir -p "$L"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$L/machine.txt" 2>&1
s=$(date +%s)
timeout -k 5 260 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/test_record_gpu.py tests/test_drain_process.py tests/test_ring.py > "$L/tests-record.log" 2>&1
echo "rc=$? tests $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"
s=$(date +%s)
{ for a in "--no-graphs" "--no-graphs --drain thread" "" "--device cpu" "--device cpu --drain thread" "--writer"; do
    timeout -k 5 120 python3 benchmarks/diag/interleave.py $a; done; } > "$L/interleave.txt" 2>&1
echo "rc=$? interleave $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"
s=$(date +%s)
timeout -k 5 280 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2> "$L/bench_record-stderr.txt"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"
date -u +%FT%TZ >> "$L/machine.txt"
tail -3 "$L/tests-record.log"; cat "$L/interleave.txt" | grep -v "^ *drain:\|^ *host:"; cat "$L/bench_record.md"
