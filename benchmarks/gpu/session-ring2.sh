#!/usr/bin/env bash
# Second device call for issue 15: bench_record, then where the time goes (graphs, eager).
set -u
timeout 300 python3 benchmarks/bench_record.py --blocks "${BLOCKS:-6}" --block-steps "${BLOCK_STEPS:-25}" --out "$OUT/bench_record.json" ${BENCH_ARGS:-} > "$OUT/bench_record.md" 2> "$OUT/bench_record.err"
echo "bench rc=$?"; cat "$OUT/bench_record.md"; tail -6 "$OUT/bench_record.err"
timeout 60 python3 benchmarks/profile_record.py --steps 100 --top 25 > "$OUT/profile-graphs.txt" 2>&1; head -7 "$OUT/profile-graphs.txt"
timeout 60 python3 benchmarks/profile_record.py --steps 60 --top 40 --no-graphs > "$OUT/profile-eager.txt" 2>&1; head -7 "$OUT/profile-eager.txt"
