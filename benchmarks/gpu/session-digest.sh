#!/usr/bin/env bash
# After the digest's default launch shape changed: its GPU tests, the recorder's GPU tests, the
# digest benchmark and the recorder overhead again.
set -u
export PYTHONPATH=$PWD
L=/tmp/dig; rm -rf $L; mkdir -p $L
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"; }
date -u +%FT%TZ > $L/machine.txt
t bench_digest 90 python3 benchmarks/bench_digest.py
t bench_record 120 python3 benchmarks/bench_record.py --blocks 6 --block-steps 25
t test-gpu-digest-record 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/test_digest_gpu.py tests/test_record_gpu.py
date -u +%FT%TZ >> $L/machine.txt
tar czf "${OUT:-/tmp}/dig.tgz" -C /tmp dig
cat $L/summary.txt; grep -E "rd64|passed|failed" $L/*.log | head
