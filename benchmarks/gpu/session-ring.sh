#!/usr/bin/env bash
# One device call for issue 15: the GPU tests of the recorder and the ring, then bench_record.
# Run from the repository root with PYTHONPATH set; writes logs and bench_record.json under $OUT.
set -u
{ nvidia-smi --query-gpu=name,driver_version --format=csv; df -h /dev/shm; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; nproc; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/test_record_gpu.py ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/test-gpu.log" | tail -15
timeout 90 python3 -m pytest -q -p no:cacheprovider -m "not slow and not gpu and not multigpu" tests/test_ring.py tests/test_recorder.py tests/test_crash.py 2>&1 | tee "$OUT/test-cpu-on-gpu-host.log" | tail -3
timeout "${BENCH_S:-280}" python3 benchmarks/bench_record.py --blocks "${BLOCKS:-6}" --block-steps "${BLOCK_STEPS:-25}" --out "$OUT/bench_record.json" ${BENCH_ARGS:-} > "$OUT/bench_record.md" 2> "$OUT/bench_record.err"
echo "bench rc=$?"
cat "$OUT/bench_record.md"; tail -8 "$OUT/bench_record.err"
