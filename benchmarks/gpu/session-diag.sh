#!/usr/bin/env bash
# One device call: recorder profile, real tuner divergence, and the two HF graph variants that did
# not pass before (torch.compile reduce-overhead; TP under hand-captured graphs), each with its log.
set -u
export PYTHONPATH=$PWD PYTHONFAULTHANDLER=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/gpus.txt" 2>&1
date -u +%FT%TZ > "$O/start.txt"
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$O/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$O/summary.txt"; }
t profile-step 90 python3 benchmarks/profile_record.py --durability step --steps 100
t profile-async 90 python3 benchmarks/profile_record.py --durability async --steps 100
t tuner 170 python3 -m pytest -q -p no:cacheprovider tests/test_bisect_gpu.py::test_real_tuner_divergence -rs --tb=short
REC=/tmp/hfdiag; rm -rf $REC; mkdir -p $REC
HF=(--steps 8 --preset small --dtype bfloat16 --device cuda)
RECIPE=(--step examples.hf_llama.engine:HFDecoder.decode_step --state replay_state --config replay_config --factory examples.hf_llama.engine:build --modules model --keyframe-every 4)
(
 t c1-plain 150 python3 -m examples.hf_llama.run "${HF[@]}" --graphs compile
 t c2-record 200 python3 -m replay record --out $REC/compile --quiet "${RECIPE[@]}" -- python3 -m examples.hf_llama.run "${HF[@]}" --graphs compile
 t c3-info 30 python3 -m replay info $REC/compile --json
 t c4-step 200 python3 -m replay step $REC/compile --rank 0 --step 6 --mode both --device cuda:0 --repeat 2 --json --no-save
) &
(
 t g1-record 200 python3 -m replay record --out $REC/tpg --quiet "${RECIPE[@]}" -- python3 -m examples.hf_llama.run "${HF[@]}" --ranks 2 --tp --graphs manual
 t g2-info 30 python3 -m replay info $REC/tpg --json
 t g3-step 200 python3 -m replay step $REC/tpg --ranks 0-1 --step 6 --mode cudagraph --devices cuda:0,cuda:1 --json --no-save
) &
wait
date -u +%FT%TZ > "$O/end.txt"
