#!/usr/bin/env bash
# Everything a GPU node should run for this repository, most important first, within about 9.5 minutes of one H100:
#   1. the CUDA-only tests (make gpu-check's step 1), while the CPU generates the table's sample data beside them;
#   2. the tutorial's single-GPU table with each lever of the step and the targets (make gpu-table);
#   3. rank 0 of the `mp` config's published layouts by dry runs (make bench-dry-run).
# Each part has a deadline (seconds from the start) and writes its JSON as it goes, so a part cut short keeps what
# it measured and the next part still runs. Reports go to DIR (default bench_results/gpu), the whole log beside them.
#   bash benchmarks/gpu_session.sh [DIR]                         # on a GPU node (PYTHON=python3 by default)
#   bash benchmarks/gpu_session.sh DIR --tiny --allow-cpu        # a check of this script on any machine
# With --lessons (first after DIR) it runs instead the tutorial's lessons as an attendee runs them, in about 8
# minutes: example runs with their logs, TensorBoard events and a profile of each step (benchmarks/gpu_lessons.py),
# packed into DIR/lessons.tar.gz; the sample data and checkpoints stay in $LESSONS_WORK (default /tmp/lessons).
set -u
dir=${1:-bench_results/gpu}
shift $(($# > 0 ? 1 : 0))
if [[ ${1:-} == --lessons ]]; then
    shift
    mkdir -p "$dir"
    work=${LESSONS_WORK:-/tmp/lessons}
    "${PYTHON:-python3}" -m benchmarks.gpu_lessons --out "$work" --pack "$dir/lessons.tar.gz" "$@" 2>&1 \
        | tee "$dir/lessons.log"
    exit "${PIPESTATUS[0]}"
fi
check=("$@")
tiny=()
[[ " ${check[*]-} " == *" --tiny "* ]] && tiny=(--tiny)
py=${PYTHON:-python3}
mkdir -p "$dir"
start=$SECONDS
status=0

until_second() {  # seconds left until second $1 of the session (at least 30)
    local left=$(($1 - (SECONDS - start)))
    echo $((left > 30 ? left : 30))
}

part() {  # part NAME DEADLINE COMMAND...: run it with a deadline, say how it ended
    local name=$1 deadline=$2
    shift 2
    echo "[session $((SECONDS - start)) s] $name: $*"
    timeout --signal=TERM --kill-after=15 "$(until_second "$deadline")" "$@"
    local rc=$?
    echo "[session $((SECONDS - start)) s] $name ended with status $rc$([[ $rc == 124 ]] && echo ' (deadline)')"
    [[ $rc == 0 ]] || status=1
}

{
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    "$py" -m benchmarks.gpu_table --data-only ${tiny[@]+"${tiny[@]}"} &
    data=$!
    part "CUDA-only tests" 150 "$py" -m benchmarks.gpu_check --skip-benchmarks ${check[@]+"${check[@]}"} \
        --out "$dir/gpu_tests.json"
    wait "$data" || status=1
    part "single-GPU table" 545 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} \
        --out "$dir/single_gpu_table.json"
    part "dry runs" 590 "$py" -m benchmarks.bench_dry_run ${tiny[@]+"${tiny[@]}"} --out "$dir/dry_run_mp.json"
    echo "[session $((SECONDS - start)) s] done, status $status"
    exit "$status"
} 2>&1 | tee "$dir/session.log"
exit "${PIPESTATUS[0]}"
