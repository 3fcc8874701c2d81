#!/usr/bin/env bash
# What a GPU node measures for this repository's open work (issue #39), most important first, within 9 minutes of one
# H100, each part with a deadline (seconds from the start) and its JSON written as it goes, so a part cut short keeps
# what it measured and the next part still runs:
#   1. the CUDA-only tests of the loaders (the cosmology crops turned on the GPU, the ring's page-locked copies),
#      then of ring attention's block kernels (CUDA's efficient attention against plain math, issue #59 item 2);
#   2. the UNet `short` rows of the single-GPU table (benchmarks/gpu_table.py) that compare on one card: fp16 + fused
#      Adam with 8 workers, the same compiled, fp32 with the config's 2 workers, and last fp16 + fused with
#      channels_last_3d (on the H100 twice cut by a deadline after 41 s and 55 s: last, so it delays no other row);
#   3. the ViT `short` bf16 rows, eager and compiled, with the attention's input cast once (the table's targets);
#   4. the ViT levers: the cast once against the cast by each of q, k and v (benchmarks/bench_levers.py);
#   5. the cosmology loader's rates on the node's CPU (benchmarks/bench_loader.py);
# and, after the first part, NCCL's paths that one rank can run (benchmarks/nccl_one_rank.py: a process group of one
# made with `device_id` and the collective timeout, DDP, DTensor and FSDP2 on it, a clean destroy; not with
# --allow-cpu, NCCL needing a GPU).
# The table merges into the committed report (each row says which machine and date measured it); --fresh (right
# after DIR, which must hold no report yet) starts a report of its own instead, for another card. On 2026-11-28 one
# H100 ran the session as it was then (bench_results/gpu/gpu_session.log: 551 s, cut by deadlines in three parts),
# and one H200 this one on an empty report, as --fresh starts (bench_results/gpu/h200/session.log: 385 s, every part
# in time). Reports go to DIR (default bench_results/gpu), the whole log beside them.
#   bash benchmarks/gpu_session.sh [DIR]                         # on a GPU node (PYTHON=python3 by default)
#   bash benchmarks/gpu_session.sh DIR --fresh                   # the same, into a report of its own
#   bash benchmarks/gpu_session.sh DIR --tiny --allow-cpu        # a check of this script on any machine
# `make gpu-check` runs every CUDA-only test, `make gpu-table` every row of the table, `make bench-dry-run` the dry
# runs.
# With --lessons (first after DIR) it runs instead the tutorial's lessons as an attendee runs them, in about 8
# minutes: example runs with their logs, TensorBoard events and a profile of each step (benchmarks/gpu_lessons.py),
# packed into DIR/lessons.tar.gz; the sample data and checkpoints stay in $LESSONS_WORK (default /tmp/lessons).
# With --multi (first after DIR) it runs the multi-GPU day on every GPU of the node (2, 4 or 8; on one GPU NCCL's
# one-rank paths only), six parts each with a deadline, 9 minutes in all, into DIR/multi_gpu.json with the logs,
# traces and figures beside it (benchmarks/gpu_multi.py); data and run directories in $MULTI_WORK (default
# /tmp/multi). `--multi --tiny --allow-cpu` rehearses it on CPU ranks over gloo (tests/perf/test_gpu_multi.py).
# With --wfm (first after DIR) it runs "one GPU, many ranks" (issue #59 item 7) on the node's first GPU, four parts each
# with a deadline, 9 minutes at most (about 3 expected), into DIR/wfm_one_gpu.json with the logs beside it
# (benchmarks/gpu_wfm.py): the 0.25-degree configs' step on one GPU (wfm_tiny, wfm_p8 at batch 1; wfm_p8's rank 0 at
# cp=2 with each --cp_method), rank 0 of wfm_1b_p4 at tp=4 x cp=4 and of each of wfm_10b_p2's two pipeline stages (dry
# runs), and 2 ranks on the one GPU (NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1, else gloo with CUDA tensors) checking
# DDP, tp=2, cp=2 by each method and pp=2 (two pipeline stages, issue #60 item 7) against the serial run; data and run
# directories in $WFM_WORK (default /tmp/wfm). `--wfm --tiny --allow-cpu` rehearses it on the CPU
# (tests/perf/test_gpu_session_wfm.py). No GPU has run it yet.
# Ctrl-C (SIGINT) or SIGTERM stops the running part with every process it started, marks it "interrupted" in the
# report (DIR/session.json; with --multi DIR/multi_gpu.json, with --wfm DIR/wfm_one_gpu.json), says what it stopped
# in one line and exits with 130; each report is replaced as the session starts, so an earlier session's never stands
# as this one's.
set -u
dir=${1:-bench_results/gpu}
shift $(($# > 0 ? 1 : 0))
py=${PYTHON:-python3}
if ! "$py" -c "import torch, h5py, yaml" 2>/dev/null; then
    echo "error: '$py' cannot import torch, h5py and yaml (it is not the project's Python); run with the project's" \
         "venv: PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh $dir${*:+ $*}" >&2
    exit 2
fi
keep_logging() {  # tee that outlives a Ctrl-C, so that the session's last lines still reach the log and the screen
    trap '' INT TERM
    exec tee "$1"
}
if [[ ${1:-} == --lessons ]]; then
    shift
    mkdir -p "$dir"
    work=${LESSONS_WORK:-/tmp/lessons}
    "$py" -m benchmarks.gpu_lessons --out "$work" --pack "$dir/lessons.tar.gz" "$@" 2>&1 \
        | keep_logging "$dir/lessons.log"
    exit "${PIPESTATUS[0]}"
fi
if [[ ${1:-} == --multi ]]; then  # benchmarks/gpu_multi.py stops its own processes on SIGINT and SIGTERM
    shift
    mkdir -p "$dir"
    "$py" -m benchmarks.gpu_multi --out "$dir" --work "${MULTI_WORK:-/tmp/multi}" "$@" 2>&1 \
        | keep_logging "$dir/multi.log"
    exit "${PIPESTATUS[0]}"
fi
if [[ ${1:-} == --wfm ]]; then  # benchmarks/gpu_wfm.py stops its own processes on SIGINT and SIGTERM
    shift
    mkdir -p "$dir"
    "$py" -m benchmarks.gpu_wfm --out "$dir" --work "${WFM_WORK:-/tmp/wfm}" "$@" 2>&1 | keep_logging "$dir/wfm.log"
    exit "${PIPESTATUS[0]}"
fi
fresh=
if [[ $dir == --* ]]; then
    echo "error: name the report's folder first: bash benchmarks/gpu_session.sh DIR $dir" >&2
    exit 2
fi
if [[ ${1:-} == --fresh ]]; then
    if [[ -e $dir/single_gpu_table.json ]]; then
        echo "error: --fresh starts a report of its own, and $dir already holds one; choose an empty DIR" >&2
        exit 2
    fi
    fresh=1
    shift
fi
check=("$@")
tiny=()
[[ " ${check[*]-} " == *" --tiny "* ]] && tiny=(--tiny)
mkdir -p "$dir"
start=$SECONDS
status=0
ended=()   # each part and how it ended, for DIR/session.json
running=   # the part running now, and the process group timeout leads for it
running_pid=
era5=

write_report() {  # write_report STATUS: DIR/session.json (replaced atomically)
    local IFS=,
    printf '{"made_by": "bash benchmarks/gpu_session.sh", "status": "%s", "seconds": %d, "parts": [%s]}\n' \
        "$1" $((SECONDS - start)) "${ended[*]-}" > "$dir/session.json.tmp" && mv "$dir/session.json.tmp" "$dir/session.json"
}

# shellcheck disable=SC2329  # called by the traps below
interrupted() {  # SIGINT or SIGTERM: stop the running part's processes, mark it, say what was stopped, exit 130
    trap '' INT TERM
    if [[ -n $running_pid ]]; then  # timeout leads a process group of its own: it, its command and their children
        kill -TERM -- "-$running_pid" 2>/dev/null
        for _ in $(seq 30); do kill -0 -- "-$running_pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$running_pid" 2>/dev/null
    fi
    [[ -n $era5 ]] && kill -TERM "$era5" 2>/dev/null
    ended+=("{\"part\": \"${running:-start-up}\", \"status\": \"interrupted\"}")
    write_report interrupted
    local what="the start-up"
    [[ -n $running ]] && what="the part \"$running\" and every process it started"
    echo "error: interrupted by SIG$1: stopped $what; $dir/session.json marks it \"interrupted\"" >&2
    exit 130
}

until_second() {  # seconds left until second $1 of the session (at least 30)
    local left=$(($1 - (SECONDS - start)))
    echo $((left > 30 ? left : 30))
}

part() {  # part NAME DEADLINE COMMAND...: run it with a deadline, say how it ended
    local name=$1 deadline=$2
    shift 2
    echo "[session $((SECONDS - start)) s] $name: $*"
    running=$name
    # in the background and waited for, so that a signal's trap runs at once (bash runs it after a foreground command)
    timeout --signal=TERM --kill-after=15 "$(until_second "$deadline")" "$@" &
    running_pid=$!
    wait "$running_pid"
    local rc=$?
    running=''
    running_pid=''
    echo "[session $((SECONDS - start)) s] $name ended with status $rc$([[ $rc == 124 ]] && echo ' (deadline)')"
    local how=ok
    [[ $rc == 0 ]] || how="status $rc"
    [[ $rc == 124 ]] && how=deadline
    ended+=("{\"part\": \"$name\", \"status\": \"$how\"}")
    write_report running
    [[ $rc == 0 ]] || status=1
}

loader_tiny=()
[[ -n ${tiny[*]-} ]] && loader_tiny=(--box 32 --crop 16 --batch 4 --nbatches 2 --warmup 1 --data_dir "$dir/cosmo_32")
UNET_ROWS=unet_fp16_fused_w8,unet_fp16_fused_jit_w8,unet_short,unet_fp16_fused_nhwc_w8
LEVERS_ARGS="--variants now,cast_by_each --attention '' --steps 15 --warmup 3"
if [[ -z ${tiny[*]-}${fresh} && ! -e $dir/single_gpu_table.json && -e bench_results/gpu/single_gpu_table.json ]]; then
    cp bench_results/gpu/single_gpu_table.json "$dir/"  # merge into the committed report (--tiny starts anew)
fi

{
    trap 'interrupted INT' INT
    trap 'interrupted TERM' TERM
    write_report running
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    "$py" -m benchmarks.gpu_table --data-only --datasets cosmo ${tiny[@]+"${tiny[@]}"} || status=1
    "$py" -m benchmarks.gpu_table --data-only --datasets era5 ${tiny[@]+"${tiny[@]}"} &
    era5=$!
    part "loader tests on the GPU" 50 "$py" -m pytest -q -m gpu tests/datasets tests/gpu/test_gpu.py -k "cosmo or ring" \
        -p no:cacheprovider
    part "ring attention's CUDA kernels" 70 "$py" -m pytest -q -m gpu tests/parallel/test_context_parallel_kernels.py \
        -p no:cacheprovider
    if [[ " ${check[*]-} " != *" --allow-cpu "* ]]; then  # NCCL's one-rank paths (benchmarks/nccl_one_rank.py)
        part "NCCL on one rank" 90 "$py" -m benchmarks.nccl_one_rank --out "$dir/nccl_one_rank.json"
    fi
    part "UNet rows" 330 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows "$UNET_ROWS" \
        --out "$dir/single_gpu_table.json"
    wait "$era5" || status=1
    part "ViT rows" 445 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows vit_bf16,vit_fused_compile \
        --out "$dir/single_gpu_table.json"
    part "ViT levers" 500 "$py" -m benchmarks.gpu_table ${check[@]+"${check[@]}"} --merge --rows levers \
        --levers-args "$LEVERS_ARGS" --out "$dir/single_gpu_table.json"
    part "cosmology loader" 540 "$py" -m benchmarks.bench_loader --dataset cosmo --workers 0 2 --threads 2 \
        ${loader_tiny[@]+"${loader_tiny[@]}"} --out "$dir/loader_cosmo.json"
    write_report "done"
    echo "[session $((SECONDS - start)) s] done, status $status"
    exit "$status"
} 2>&1 | keep_logging "$dir/session.log"
exit "${PIPESTATUS[0]}"
