#!/usr/bin/env bash
# Issue 15, seventeenth session, first device call: what each part of the recorder costs an eager
# CUDA step and a CPU step (benchmarks/diag/ablate.py: the recorded step with one part left out,
# blocks interleaved with the plain step), and where the eager step's host time goes
# (host_phases.py --fine, step_pyprofile.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=${OUT:-/tmp/check17}; mkdir -p "$L"
S="$L/summary.txt"
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; nproc; } > "$S" 2>&1
A="$L/ablate.txt"
for args in "--device cpu --preset tiny --blocks 60" "--device cuda --preset small --blocks 40" "--device cpu --preset tiny --blocks 60" "--device cuda --preset small --blocks 40"; do
  s=$(date +%s); echo "== ablate.py $args" >> "$A"
  timeout -k 5 100 python3 benchmarks/diag/ablate.py $args >> "$A" 2>&1
  echo "rc=$? ablate $args $(( $(date +%s) - s ))s" | tee -a "$S"
done
H="$L/host_phases.txt"
s=$(date +%s)
timeout -k 5 80 python3 benchmarks/diag/host_phases.py --no-graphs --fine --steps 300 > "$H" 2>&1
echo "rc=$? host_phases $(( $(date +%s) - s ))s" | tee -a "$S"
P="$L/pyprofile.txt"
timeout -k 5 70 python3 benchmarks/diag/step_pyprofile.py --steps 200 --top 50 > "$P" 2>&1
echo "rc=$? pyprofile" | tee -a "$S"
date -u +%FT%TZ >> "$S"
cat "$S" "$A" "$H" | tail -120
