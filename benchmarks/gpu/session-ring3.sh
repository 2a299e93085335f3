#!/usr/bin/env bash
# Final device call for issue 15: the GPU tests, bench_record (the figures), profiles.
set -u
{ nvidia-smi --query-gpu=name,driver_version --format=csv; df -h /dev/shm; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; } > "$OUT/machine.txt" 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_record_gpu.py 2>&1 | tee "$OUT/test-gpu.log" | tail -4
timeout 240 python3 benchmarks/bench_record.py --blocks 6 --block-steps 25 --out "$OUT/bench_record.json" > "$OUT/bench_record.md" 2> "$OUT/bench_record.err"
echo "bench rc=$?"; cat "$OUT/bench_record.md"; tail -6 "$OUT/bench_record.err"
timeout 45 python3 benchmarks/profile_record.py --steps 100 --top 25 > "$OUT/profile-graphs.txt" 2>&1; head -7 "$OUT/profile-graphs.txt"
timeout 45 python3 benchmarks/profile_record.py --steps 60 --top 40 --no-graphs > "$OUT/profile-eager.txt" 2>&1; head -7 "$OUT/profile-eager.txt"
