# shellcheck shell=bash
# Sourced by submit_pm.sh, submit_pm_dp.sh and submit_pm_mp.sh (in the batch job, from the submission directory:
# the repository root) after they set TRAINING_SCRIPT's default. It checks the job's settings, prepares the
# environment and leaves two arrays for the script's own srun line:
#   command       python $TRAINING_SCRIPT <the sbatch arguments>, wrapped in nsys when ENABLE_PROFILING=1
#   shifter_args  the /data and /logs mounts, and --image=$IMAGE when IMAGE is set
# Usage: source submit_common.sh "$@"

case "$TRAINING_SCRIPT" in
    train.py | train_graph.py | train_mp.py | train_mp_graphs.py) ;;
    *) echo "error: TRAINING_SCRIPT='$TRAINING_SCRIPT' is not one of train.py, train_graph.py, train_mp.py," \
            "train_mp_graphs.py" >&2
       exit 2 ;;
esac
if [ ! -f "$TRAINING_SCRIPT" ]; then
    echo "error: $TRAINING_SCRIPT is not in $PWD; submit from the repository root (the job runs where sbatch ran)" >&2
    exit 2
fi
if [ -z "${SLURM_JOB_NODELIST:-}" ]; then
    echo "error: not inside a Slurm job; submit with sbatch (or run it in an salloc allocation)" >&2
    exit 2
fi

DATADIR=${DATADIR:-/pscratch/sd/s/shas1693/data/dl-at-scale-training-data}
if [ -z "${LOGDIR:-}" ] && [ -z "${SCRATCH:-}" ]; then
    echo "error: neither LOGDIR nor SCRATCH is set; set LOGDIR (default \$SCRATCH/dl-at-scale-training/logs)" >&2
    exit 2
fi
LOGDIR=${LOGDIR:-$SCRATCH/dl-at-scale-training/logs}
mkdir -p "$LOGDIR" || exit 2

export HDF5_USE_FILE_LOCKING=FALSE
# the NCCL network plugin over Slingshot (libfabric) needs this memory-registration cache monitor, on every node
export FI_MR_CACHE_MONITOR=userfaultfd

# rank 0 runs on the first node of the allocation: the others meet it there (also from other nodes)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR

command=(python "$TRAINING_SCRIPT" "$@")
# Profiling: nsys records the window the script opens with cudaProfilerStart/Stop (4th epoch by default); every rank
# opens it, and with several ranks each writes its own file (nsys fills in %q{SLURM_PROCID})
if [ "${ENABLE_PROFILING:-0}" = 1 ]; then
    echo "Enabling profiling..."
    # NVTX ranges by plain string (PyTorch's) count for --capture-range=nvtx; by default nsys matches registered ones only
    export NSYS_NVTX_PROFILER_REGISTER_ONLY=0
    nsys_args=("--trace=cuda,cublas,nvtx" --kill none -c cudaProfilerApi -f true)
    case "$TRAINING_SCRIPT" in
        *graph*) nsys_args+=(--cuda-graph-trace=node) ;;  # kernels inside CUDA graphs, one by one
    esac
    nsys_output=$LOGDIR/${PROFILE_OUTPUT:-profile}
    if [ "${SLURM_NTASKS:-$((${SLURM_NNODES:-1} * ${SLURM_NTASKS_PER_NODE:-1}))}" != 1 ]; then
        nsys_output=${nsys_output}_rank'%q{SLURM_PROCID}'
    fi
    command=(nsys profile "${nsys_args[@]}" -o "$nsys_output" "${command[@]}")
fi

shifter_args=(-V "$DATADIR:/data" -V "$LOGDIR:/logs")
if [ -n "${IMAGE:-}" ]; then
    shifter_args=(--image="$IMAGE" "${shifter_args[@]}")
fi
