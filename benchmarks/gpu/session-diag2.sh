#!/usr/bin/env bash
# Second diagnostic call: recorder profile on the H200, where the TP + CUDA graph run hangs (with
# and without replay; stacks of every process still alive after 60 s), and the tuner test's log.
set -u
export PYTHONPATH=$PWD PYTHONFAULTHANDLER=1
L=/tmp/diaglogs; rm -rf $L; mkdir -p $L/stacks-plain $L/stacks-rec
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1; echo "rc=$? ${name} $(( $(date +%s) - s ))s" | tee -a "$L/summary.txt"; }
date -u +%FT%TZ > $L/start.txt
t profile-step 100 python3 benchmarks/profile_record.py --durability step --steps 100 --top 40
t profile-async 100 python3 benchmarks/profile_record.py --durability async --steps 100 --top 40
HF=(--steps 8 --preset small --dtype bfloat16 --device cuda --ranks 2 --tp --graphs manual)
RECIPE=(--step examples.hf_llama.engine:HFDecoder.decode_step --state replay_state --config replay_config --factory examples.hf_llama.engine:build --modules model --keyframe-every 4)
D=$PWD/benchmarks/gpu/hangdiag
( HANGDIAG_AFTER=60 HANGDIAG_DIR=$L/stacks-plain PYTHONPATH=$PWD:$D t hang-plain 100 python3 -m examples.hf_llama.run "${HF[@]}" ) &
( HANGDIAG_AFTER=60 HANGDIAG_DIR=$L/stacks-rec PYTHONPATH=$PWD:$D t hang-rec 100 python3 -m replay record --out /tmp/tpg --quiet "${RECIPE[@]}" -- python3 -m examples.hf_llama.run "${HF[@]}" ) &
wait
t tuner 200 python3 -m pytest -q -p no:cacheprovider tests/test_bisect_gpu.py::test_real_tuner_divergence -rs --tb=long
date -u +%FT%TZ > $L/end.txt
tar czf "${OUT:-/tmp}/diag2.tgz" -C /tmp diaglogs
cat $L/summary.txt
