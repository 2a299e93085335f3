#!/usr/bin/env bash
# Issue 15, twenty-fifth session, second device call: the GPU suite lane the first call's limit
# cut off (tests/test_newcomer_trial12.py and trial14.py), on the final tree, then the overhead
# benchmark alone on the machine (no A/B rows: they do not fit the call), its JSON kept.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check25}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
s=$(date +%s)
timeout -k 5 ${TLIM:-240} python3 -m pytest -q -p no:cacheprovider -rs --tb=short --durations=5 -n 4 tests/test_newcomer_trial12.py tests/test_newcomer_trial14.py > "$L/lane-trials.log" 2>&1
echo "rc=$? lane-trials $(( $(date +%s) - s ))s" >> "$S"
{ grep -E "^FAILED|^ERROR|^SKIPPED" "$L/lane-trials.log"; tail -1 "$L/lane-trials.log"; } >> "$S"
s=$(date +%s)
timeout -k 5 ${BLIM:-300} python3 benchmarks/bench_record.py --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" >> "$S"
date -u +%FT%TZ >> "$S"
cat "$S" "$L/bench_record.md"
