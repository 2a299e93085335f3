#!/usr/bin/env bash
# Issue 15, thirteenth session, one device call (under 560 s): the whole GPU suite in four lanes
# with the step's area (a step's small CUDA tensors packed into one kept buffer), then the
# overhead benchmark (bench_record.py --ab), then where the eager step's time goes
# (host_phases.py --fine) and paired steps with the area on and off (interleave.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check13}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head -20; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short)
t lane-record 280 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py &
t lane-foreign 280 "${PT[@]}" -m "gpu or multigpu" tests/test_foreign_record.py tests/test_foreign_rerun.py tests/test_newcomer_trial2.py tests/test_step_signatures.py &
t lane-digest 280 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py tests/test_record_signals.py -m "gpu or multigpu or not slow" &
t lane-hf-bisect 280 "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
if [ -n "${QUICK:-}" ]; then  # the last call of a session's budget: the A/B pairs before the benchmark
  t interleave-eager 80 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160
  t interleave-graphs 60 python3 benchmarks/diag/interleave.py --pairs 160
fi
s=$(date +%s)
timeout -k 5 150 python3 benchmarks/bench_record.py --ab --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
if [ -z "${QUICK:-}" ]; then
  t host-phases-eager-fine 60 python3 benchmarks/diag/host_phases.py --no-graphs --steps 200 --fine
  t interleave-eager 80 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160
  t host-phases-eager-ops 60 python3 benchmarks/diag/host_phases.py --no-graphs --steps 200 --fine --torch-ops
fi
date -u +%FT%TZ >> "$S"
for f in "$L"/lane-*.log; do echo "== $f"; grep -E "^FAILED|^ERROR" "$f"; tail -2 "$f"; done
cat "$S" "$L/bench_record.md" "$L"/interleave-*.log
