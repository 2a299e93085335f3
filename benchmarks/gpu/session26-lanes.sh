#!/usr/bin/env bash
# Issue 15, twenty-sixth session: the GPU suite lanes that did not finish in 200 s on the first call (lane-record passed there) (every test
# `make test-gpu` selects, -m "gpu or multigpu", and the ring/drain/crash/signal tests) on the
# final tree. Logs stay on the machine; failures and skips come back in summary.txt.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check26s}; mkdir -p "$L"; G=/tmp/lanes26; mkdir -p "$G"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; git log --oneline -1; } > "$S" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$G/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short --durations=5)
t lane-foreign ${LIM:-300} "${PT[@]}" -m "gpu or multigpu" tests/test_foreign_record.py tests/test_foreign_rerun.py tests/test_newcomer_trial2.py tests/test_step_signatures.py tests/test_newcomer_trial7.py &
t lane-digest ${LIM:-300} "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py tests/test_record_signals.py tests/test_unrecordable_args.py -m "gpu or multigpu or not slow" &
t lane-trials ${LIM:-300} "${PT[@]}" tests/test_newcomer_trial12.py tests/test_newcomer_trial14.py &
t lane-hf-bisect ${LIM:-300} "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
date -u +%FT%TZ >> "$S"
for f in "$G"/lane-*.log; do
  n=$(basename "$f" .log)
  { echo "== $n"; grep -E "^FAILED|^ERROR|^SKIPPED" "$f"; tail -1 "$f"; } >> "$S"
  grep -qE "^FAILED|^ERROR| failed| error" "$f" && cp "$f" "$L/$n.log"
done
cat "$S"
# then, alone on the machine: the drain process's scheduling on a CPU decode step (DIAG=0: not
# run), and the overhead benchmark (BLIM=0: not run)
if [ "${DIAG:-1}" != 0 ]; then
  s=$(date +%s)
  timeout -k 5 ${DLIM:-150} python3 benchmarks/diag/drain_priority.py --rounds ${DROUNDS:-2} --cpu-blocks 16 --out "$L/drain_priority.json" > "$L/drain_priority.txt" 2>> "$S"
  echo "rc=$? drain_priority $(( $(date +%s) - s ))s" | tee -a "$S"
  cat "$L/drain_priority.txt"
fi
[ "${BLIM:-280}" = 0 ] && { cat "$S"; exit 0; }
s=$(date +%s)
timeout -k 5 ${BLIM:-280} python3 benchmarks/bench_record.py $( [ "${AB:-1}" = 0 ] || echo --ab ) --out "$L/bench_record.json" > "$L/bench_record.md" 2>> "$S"
echo "rc=$? bench $(( $(date +%s) - s ))s" | tee -a "$S"
date -u +%FT%TZ >> "$S"
cat "$L/bench_record.md"
