#!/usr/bin/env bash
# The GPU run behind RESULTS.md's 2026-11-30 evening figures: recorder overhead (alone on the
# machine), its profile, then the GPU tests in two lanes (the Hugging Face example in one; digest,
# recorder, MTP engine and bisect, including the real tuner divergence test, in the other).
set -u
export PYTHONPATH=$PWD
L=/tmp/final; rm -rf $L; mkdir -p $L
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__, triton.__version__)"; } > $L/machine.txt 2>&1
t bench_record 170 python3 benchmarks/bench_record.py --blocks 6 --block-steps 25
t profile-step 45 python3 benchmarks/profile_record.py --durability step --steps 100 --top 30
PT=(python3 -m pytest -q -p no:cacheprovider -rs --tb=short -o faulthandler_timeout=330)
t test-gpu-lane-a 360 "${PT[@]}" -m "(gpu or multigpu) and not slow" tests/test_digest_gpu.py tests/test_record_gpu.py tests/test_mtp_gpu.py tests/test_bisect_gpu.py -s &
t test-gpu-lane-b 360 "${PT[@]}" -m "(gpu or multigpu) and not slow" tests/test_hf_gpu.py &
wait
date -u +%FT%TZ >> $L/machine.txt
tar czf "${OUT:-/tmp}/final.tgz" -C /tmp final
cat $L/summary.txt
