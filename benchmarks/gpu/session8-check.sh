#!/usr/bin/env bash
# Issue 15, eighth session, first device call on one H200 (under 600 s): the eager CUDA and CPU
# steps paired plain/recorded (benchmarks/diag/interleave.py) for the tree before this session's
# changes (old_tree/: `git archive` of 09c6dfd) and this tree, alternating; the host phases of
# this tree (graphs, eager); then the GPU suite in three lanes (with the ring's, the drain
# process's and the recorder's CPU tests beside them).
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check8}; mkdir -p "$L"
here=$PWD
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
il() { (cd "$1" && PYTHONPATH=$PWD timeout -k 5 80 python3 benchmarks/diag/interleave.py "${@:2}"); }
s=$(date +%s)
{ for i in 1 2; do for tree in old_tree .; do for a in --no-graphs "--device cpu"; do
    echo "== $tree $a ($i)"; il "$here/$tree" $a; done; done; done; } > "$L/ab-interleave.txt" 2>&1
echo "rc=$? ab-interleave $(( $(date +%s) - s ))s" | tee -a "$S"
rm -rf "$here/old_tree"
export PYTHONPATH=$here
{ timeout -k 5 60 python3 benchmarks/diag/host_phases.py --steps 150; timeout -k 5 60 python3 benchmarks/diag/host_phases.py --no-graphs --steps 100; } > "$L/host_phases.txt" 2>&1
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$S"; }
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short)
t lane-record 300 "${PT[@]}" -m "gpu or multigpu" tests/test_record_gpu.py tests/test_mtp_gpu.py tests/test_foreign_record.py tests/test_foreign_rerun.py &
t lane-digest 300 "${PT[@]}" tests/test_digest_gpu.py tests/test_drain_process.py tests/test_ring.py tests/test_crash.py tests/test_recorder.py -m "gpu or multigpu or not slow" &
t lane-hf-bisect 300 "${PT[@]}" -m "gpu or multigpu" tests/test_hf_gpu.py tests/test_bisect_gpu.py &
wait
date -u +%FT%TZ >> "$S"
for f in "$L"/lane-*.log; do echo "== $f"; grep -E "^FAILED|^ERROR" "$f"; tail -2 "$f"; done
grep -E "^==|^  recorded  |variant" "$L/ab-interleave.txt"
grep -E "small graphs|until the body|end_step|Staging|record_" "$L/host_phases.txt"
cat "$S"
