#!/usr/bin/env bash
# Issue 15, eighth session: the CUDA-graph rows of the overhead benchmark for 09c6dfd (old_tree/:
# `git archive 09c6dfd`) and this tree, alternating three times on one H200: whether this
# session's changes (none on the recorded step's path of the reference engine) moved the figure.
set -u
export PYTHONUNBUFFERED=1
L=${OUT:-/tmp/ab8}; mkdir -p "$L"
here=$PWD
b() { (cd "$1" && PYTHONPATH=$PWD timeout -k 5 60 python3 benchmarks/bench_record.py --only graphs --out "$L/$2.json" > "$L/$2.md" 2>&1); echo "rc=$? $2"; }
date -u +%FT%TZ > "$L/summary.txt"
for i in 1 2 3; do b "$here/old_tree" "old-$i"; b "$here" "new-$i"; done >> "$L/summary.txt"
date -u +%FT%TZ >> "$L/summary.txt"
rm -rf "$here/old_tree"
cat "$L/summary.txt"; for f in "$L"/*.md; do echo "== $f"; grep -E "default settings|metadata" "$f"; done
