#!/usr/bin/env bash
# Issue 15, sixth session: host phases of the tree before this session's changes (old_tree/, a
# `git archive` of the last commit) and of the working tree, alternating, then the GPU suite's lanes.
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/ab}; mkdir -p "$L"
here=$PWD
hp() { (cd "$1" && PYTHONPATH=$PWD timeout 90 python3 benchmarks/diag/host_phases.py "${@:2}"); }
for i in 1 2; do
  echo "== old eager $i"; hp "$here/old_tree" --no-graphs --steps 100
  echo "== new eager $i"; hp "$here" --no-graphs --steps 100
done > "$L/ab-eager.txt" 2>&1
{ echo "== old graphs"; hp "$here/old_tree" --steps 200; echo "== new graphs"; hp "$here" --steps 200; } > "$L/ab-graphs.txt" 2>&1
PYTHONPATH=$here timeout 90 python3 benchmarks/diag/step_pyprofile.py --top 200 > "$L/pyprofile-eager.txt" 2>&1
rm -rf "$here/old_tree"
SUITE_ONLY=1 OUT=$L/suite bash benchmarks/gpu/session-drain-final.sh > "$L/suite.txt" 2>&1
grep -E "^==|until|end_step|stage|seal|record_|early" "$L"/ab-*.txt; cat "$L/suite.txt"
