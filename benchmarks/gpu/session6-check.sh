set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
( SUITE_ONLY=1 OUT=$OUT/suite bash benchmarks/gpu/session-drain-final.sh > $OUT/suite.txt 2>&1 ) &
sleep 200
for g in "" "--graphs"; do timeout 90 python3 benchmarks/diag/step_ops.py $g; done > $OUT/step_ops.txt 2>&1
wait
timeout 60 python3 benchmarks/diag/host_phases.py --no-graphs --steps 100 > $OUT/host_phases.txt 2>&1
cat $OUT/suite.txt $OUT/step_ops.txt $OUT/host_phases.txt
