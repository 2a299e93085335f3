#!/usr/bin/env bash
# The closing device call of issue 15's fourth and fifth sessions on one H200 (under 600 s): the whole GPU
# suite in three lanes (with the drain process's and the ring's CPU tests beside them), then the
# full-logits writer with either drain, then the overhead benchmark, then the step pairs of
# benchmarks/diag/interleave.py (eager CUDA, CPU); eight files under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/gpu-final}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short)
t lane-record 330 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py tests/test_foreign_record.py tests/test_foreign_rerun.py &
t lane-digest 330 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py -m "gpu or multigpu or not slow" &
t lane-hf-bisect 330 "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
# SUITE_ONLY=1: the test lanes alone (a check of new commits before the figures are taken).
if [ "${SUITE_ONLY:-0}" = 1 ]; then for f in "$L"/lane-*.log; do echo "== $f"; tail -3 "$f"; done; exit 0; fi
s=$(date +%s)
{ timeout -k 5 60 python3 benchmarks/diag/interleave.py --writer; timeout -k 5 60 python3 benchmarks/diag/interleave.py --writer --drain thread; } > "$L/writer.txt" 2>&1
echo "rc=$? writer $(( $(date +%s) - s ))s" | tee -a "$S"
s=$(date +%s)
timeout -k 5 200 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
s=$(date +%s)
{ timeout -k 5 60 python3 benchmarks/diag/interleave.py --no-graphs; timeout -k 5 60 python3 benchmarks/diag/interleave.py --device cpu; } > "$L/interleave.txt" 2>&1
echo "rc=$? interleave $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
for f in "$L"/lane-*.log; do echo "== $f"; tail -3 "$f"; done
grep -v "^  host:" "$L/writer.txt"; cat "$L/bench_record.md" "$L/interleave.txt"
