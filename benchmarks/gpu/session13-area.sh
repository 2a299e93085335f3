#!/usr/bin/env bash
# Issue 15, thirteenth session: the step's area (small CUDA tensors packed with one copy a call,
# one copy into the ring a step). GPU tests of the recorder's CUDA path, then where the eager
# step's recorder time goes now (development figures).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/area13}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.txt" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" >> "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short -x)
t lane-record 240 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py &
t lane-digest 240 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py -m "gpu or multigpu or not slow" &
wait
t host-phases-eager 120 python3 benchmarks/diag/host_phases.py --no-graphs --steps 200
t interleave-eager 150 python3 benchmarks/diag/interleave.py --no-graphs --pairs 160
cat "$S"; for f in "$L"/lane-*.txt; do echo "=== $f"; grep -E "^FAILED|^ERROR|Error|error" "$f" | head -30; tail -3 "$f"; done
for f in "$L"/host-*.txt "$L"/inter*.txt; do echo "=== $f"; cat "$f"; done
