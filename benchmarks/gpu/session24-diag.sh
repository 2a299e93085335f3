#!/usr/bin/env bash
# Issue 15, twenty-fourth session, first device call: where an eager CUDA step's recorder time
# goes (+8.8% on an H100 in the twenty-first session, against +2.3% with graphs), on the tree as
# the session began: host phases (whole phases, then fine timers) and the recorder's Python under
# cProfile, alone on the machine; then the GPU suite in lanes (session22-suite.sh's, DIAG=0
# BLIM=0: no benchmark), the first GPU run of the twenty-third session's changes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check24}; mkdir -p "$L"
S="$L/diag.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; git log -1 --format=%h; } > "$S" 2>&1
t() { local name=$1; shift; local s=$(date +%s); timeout -k 5 "$@" > "$L/$name.txt" 2>&1; echo "rc=$? $name $(( $(date +%s) - s ))s" >> "$S"; }
t host_phases_eager 80 python3 benchmarks/diag/host_phases.py --device cuda --preset small --no-graphs --steps 300
[ "${FINE:-1}" = 0 ] || t host_phases_eager_fine 80 python3 benchmarks/diag/host_phases.py --device cuda --preset small --no-graphs --fine --steps 300
[ "${PROFILE:-1}" = 0 ] || t pyprofile_eager 80 python3 benchmarks/diag/step_pyprofile.py --device cuda --preset small --steps 200 --top 50
cat "$S"; tail -3 "$L/host_phases_eager.txt"; tail -40 "$L/host_phases_eager_fine.txt"; head -56 "$L/pyprofile_eager.txt"
[ "${SUITE:-1}" = 0 ] || DIAG=0 BLIM=0 LIM=${LIM:-280} bash benchmarks/gpu/session22-suite.sh
