#!/usr/bin/env bash
# Issue 15, seventh session: the fix for forked children (the RNG capture's CUDA readers are
# forgotten at fork) on one H200: the two GPU test lanes that hold the fork and kill tests and
# the recorded CUDA steps, side by side, then the overhead benchmark again on this tree.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/verify7}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; git log --oneline -1 2>/dev/null; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short)
t lane-record 330 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py tests/test_foreign_record.py tests/test_foreign_rerun.py &
t lane-digest 330 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py -m "gpu or multigpu or not slow" &
wait
s=$(date +%s)
timeout -k 5 200 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
for f in "$L"/lane-*.log; do echo "== $f"; grep -E "^FAILED" "$f"; tail -2 "$f"; done
cat "$S" "$L/bench_record.md"
