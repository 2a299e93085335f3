#!/usr/bin/env bash
# One device call for `make test-gpu` on one H200 within the 600 s limit of a call: the GPU tests
# in three lanes at once (the whole suite run serially took over 480 s on 2026-12-02), logs and a
# summary under $OUT. Run the overhead benchmark alone, in its own call, afterwards:
#   python3 benchmarks/bench_record.py --blocks 6 --block-steps 25 --eager-blocks 16 --ab --out $OUT/bench_record.json
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/gpu-session}; mkdir -p "$L"
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; } > "$L/machine.txt" 2>&1
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m "gpu or multigpu")
t lane-record 500 "${PT[@]}" tests/test_record_gpu.py tests/test_mtp_gpu.py tests/test_foreign_record.py tests/test_foreign_rerun.py &
t lane-digest 500 "${PT[@]}" tests/test_digest_gpu.py &
t lane-hf-bisect 500 "${PT[@]}" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
date -u +%FT%TZ >> "$L/machine.txt"
cat "$L/summary.txt"
