#!/usr/bin/env bash
# Issue 15, fifteenth session: the whole GPU suite in four lanes, then the overhead benchmark
# (bench_record.py --ab) on the tree with the CPU copies by memmove and the meta templates.

set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check15}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --durations=5)
t lane-record 300 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py &
t lane-foreign 300 "${PT[@]}" -m "gpu or multigpu" tests/test_foreign_record.py tests/test_foreign_rerun.py tests/test_newcomer_trial2.py tests/test_step_signatures.py &
t lane-digest 300 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py tests/test_record_signals.py -m "gpu or multigpu or not slow" &
t lane-hf-bisect 300 "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
s=$(date +%s)
timeout -k 5 170 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
# Where the rest of the eager and CPU cost goes, on this host.
t interleave-eager 60 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160 --only recorded
t interleave-cpu 60 python3 benchmarks/diag/interleave.py --device cpu --preset tiny --pairs 400 --only recorded
t host-phases-eager-fine 60 python3 benchmarks/diag/host_phases.py --no-graphs --fine
date -u +%FT%TZ >> "$S"
for f in "$L"/lane-*.log; do echo "== $f"; grep -E "^FAILED|^ERROR" "$f"; grep -A6 "slowest" "$f"; tail -1 "$f"; done
cat "$S" "$L/bench_record.md" "$L"/interleave-*.log
