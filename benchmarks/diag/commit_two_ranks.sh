#!/usr/bin/env bash
# Two ranks recorded on one GPU (the recording of tests/test_bisect_gpu.py's tuner test), with
# the ring's commit word by a device counter and a copy (default) and by the driver's stream
# write (REPLAY_DIAG_DRIVER_COMMIT=1 through ./driver_commit/sitecustomize.py), alternately:
# each run's exit status, seconds and the steps each rank's recording holds.
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
T=$(mktemp -d)
for i in 1 2 3; do
  for mode in counter stream; do
    dc=0; [ $mode = stream ] && dc=1
    s=$(date +%s)
    REPLAY_DIAG_DRIVER_COMMIT=$dc PYTHONPATH="$R/benchmarks/diag/driver_commit:$R" timeout -k 5 ${LIMIT:-60} \
      python3 -m replay record --out "$T/$mode-$i" --quiet --keyframe-every 1 -- \
      python3 -m replay.workloads.mtp --device ${DEVICE:-cuda} --ranks 2 --steps 3 ${GRAPHS---cudagraph} --tuner independent --no-lockstep > "$T/$mode-$i.log" 2>&1
    rc=$?
    e=$(date +%s)
    steps=$(PYTHONPATH="$R" python3 -m replay info --json "$T/$mode-$i" 2>&1 | python3 -c "
import json, sys
try:
    d = json.load(sys.stdin)
    print([(r['rank'], r['steps'], 'complete' if r['complete'] else 'incomplete') for r in d['ranks']])
except Exception as x:
    print('unreadable:', x)")
    echo "$mode run $i  rc=$rc  $((e - s)) s  per rank (rank, steps, complete): $steps"
    [ $rc -ne 0 ] && tail -5 "$T/$mode-$i.log"
  done
done
