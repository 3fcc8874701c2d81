#!/usr/bin/env bash
# What a GPU node measures for this repository's open work (issue #39), most important first, within 9 minutes of one
# H100, each part with a deadline (seconds from the start) and its JSON written as it goes, so a part cut short keeps
# what it measured and the next part still runs:
#   1. the CUDA-only tests of the loaders (the cosmology crops turned on the GPU, the ring's page-locked copies);
#   2. the UNet `short` rows of the single-GPU table with the loader of today: fp32 and fp16 + fused Adam with the
#      config's 2 workers (input-bound in fp16), then 8 workers, channels_last_3d, compile, bf16, fp32 with 8 workers
#      (benchmarks/gpu_table.py);
#   3. the ViT step's levers, eager and compiled (benchmarks/bench_levers.py, into the same table);
#   4. the dry runs of tp=4 + sequence parallel + checkpointing and dp=16 FSDP (`mp` config);
#   5. the `mp` config at tp=1 on one GPU, compiled and eager;
#   6. the cosmology loader's rates on the node's CPU (benchmarks/bench_loader.py).
# On 2026-11-28 one H100 ran it in 551 s: parts 2, 3 and 5 were cut by their deadlines (bench_results/gpu/
# gpu_session.log); their order now puts first what that run did not reach.
# The table and the dry runs merge into the committed reports (each row says which machine and date measured it).
# Reports go to DIR (default bench_results/gpu), the whole log beside them.
#   bash benchmarks/gpu_session.sh [DIR]                         # on a GPU node (PYTHON=python3 by default)
#   bash benchmarks/gpu_session.sh DIR --tiny --allow-cpu        # a check of this script on any machine
# `make gpu-check` runs every CUDA-only test and `make gpu-table` every row of the table.
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

loader_tiny=()
[[ -n ${tiny[*]-} ]] && loader_tiny=(--box 32 --crop 16 --batch 4 --nbatches 2 --warmup 1 --data_dir "$dir/cosmo_32")
dry_layouts="tp=4 dp=4 sequence,dp=16"  # the two the 2026-11-27 session's deadline cut
[[ -n ${tiny[*]-} ]] && dry_layouts="tp=2 dp=2"
UNET_ROWS=unet_short,unet_fp16_fused,unet_fp16_fused_w8,unet_fp16_fused_nhwc_w8,unet_fp16_fused_jit_w8,unet_bf16_fused_w8,unet_w8
LEVERS_ARGS="--variants now,qkv_one_gemm,cast_by_each --attention '' --compiled default,reduce-overhead,kept --steps 15 --warmup 3"
if [[ -z ${tiny[*]-} ]]; then  # merge into the committed reports (a --tiny check starts from nothing)
    for report in single_gpu_table.json dry_run_mp.json; do
        [[ -e $dir/$report || ! -e bench_results/gpu/$report ]] || cp "bench_results/gpu/$report" "$dir/$report"
    done
fi

{
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    "$py" -m benchmarks.gpu_table --data-only --datasets cosmo ${tiny[@]+"${tiny[@]}"} || status=1
    "$py" -m benchmarks.gpu_table --data-only --datasets era5 ${tiny[@]+"${tiny[@]}"} &
    era5=$!
    part "loader tests on the GPU" 50 "$py" -m pytest -q -m gpu tests/datasets tests/gpu/test_gpu.py -k "cosmo or ring" \
        -p no:cacheprovider
    part "UNet rows" 290 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows "$UNET_ROWS" \
        --out "$dir/single_gpu_table.json"
    wait "$era5" || status=1
    part "ViT levers" 430 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows levers \
        --levers-args "$LEVERS_ARGS" --out "$dir/single_gpu_table.json"
    part "dry runs" 480 "$py" -m benchmarks.bench_dry_run ${tiny[@]+"${tiny[@]}"} --merge \
        --layouts "$dry_layouts" --out "$dir/dry_run_mp.json"
    part "mp tp=1" 520 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows mp_tp1_compile,mp_tp1 \
        --out "$dir/single_gpu_table.json"
    part "cosmology loader" 540 "$py" -m benchmarks.bench_loader --dataset cosmo --workers 0 2 --threads 2 \
        ${loader_tiny[@]+"${loader_tiny[@]}"} --out "$dir/loader_cosmo.json"
    echo "[session $((SECONDS - start)) s] done, status $status"
    exit "$status"
} 2>&1 | tee "$dir/session.log"
exit "${PIPESTATUS[0]}"
