# shellcheck shell=bash
# Sourced by submit_pm.sh, submit_pm_dp.sh and submit_pm_mp.sh (in the batch job, from the submission directory:
# the repository root) after they set TRAINING_SCRIPT's default. It checks the job's settings, prepares the
# environment and leaves two arrays for the script's own srun line, and one function for after it:
#   command       python $TRAINING_SCRIPT <the sbatch arguments>, wrapped in nsys when ENABLE_PROFILING=1
#   shifter_args  the /data and /logs mounts, PYTHONUSERBASE=$LOGDIR, and --image=$IMAGE when IMAGE is set
#   requeue_or_exit STATUS   ends the job with srun's status; on 75 (or $REQUEUE_MARKER made by the ranks) it first
#                            requeues the job (docs/cluster.md)
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
if [ ! -d "$DATADIR" ]; then
    echo "error: DATADIR='$DATADIR' is not a directory; set DATADIR to the folder that holds train/ and valid/" \
         "(it is mounted at /data)" >&2
    exit 2
fi
if [ -z "${LOGDIR:-}" ] && [ -z "${SCRATCH:-}" ]; then
    echo "error: neither LOGDIR nor SCRATCH is set; set LOGDIR (default \$SCRATCH/dl-at-scale-training/logs)" >&2
    exit 2
fi
LOGDIR=${LOGDIR:-$SCRATCH/dl-at-scale-training/logs}
if ! mkdir -p "$LOGDIR" 2>/dev/null || [ ! -w "$LOGDIR" ]; then
    echo "error: LOGDIR='$LOGDIR' cannot be created or written; set LOGDIR to a folder you can write (it is" \
         "mounted at /logs; run directories and profiles land there)" >&2
    exit 2
fi

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

# PYTHONUSERBASE (as sc25's scripts): Python's user site-packages inside the container resolve under LOGDIR, not
# ~/.local, where packages installed with `pip install --user` for another Python would shadow the image's own
shifter_args=(-V "$DATADIR:/data" -V "$LOGDIR:/logs" --env "PYTHONUSERBASE=$LOGDIR")
if [ -n "${IMAGE:-}" ]; then
    shifter_args=(--image="$IMAGE" "${shifter_args[@]}")
fi

# Every rank that stops with a checkpoint creates this file before it exits 75 (lifecycle/signals.py): with
# --kill-on-bad-exit Slurm kills the ranks still ending after the first one's exit, so srun's status may be theirs
# (137) rather than 75. In the submission directory, where the container runs too.
export REQUEUE_MARKER=$PWD/.requeue-${SLURM_JOB_ID:-job}
rm -f "$REQUEUE_MARKER"

# Slurm's own SIGTERM (scancel, a preemption, the time limit itself) reaches this shell as well as the ranks. Untrapped,
# bash would die at once, srun's status unread; trapped, bash runs the trap once srun has returned. (Not
# `trap '' TERM`: an ignored signal stays ignored in every child, the ranks included.)
trap 'ended_by_slurm=SIGTERM' TERM

# After srun: the training scripts exit 75 (EX_TEMPFAIL) when a signal stopped them after a checkpoint. On the warning
# the submit scripts ask for (`#SBATCH --signal=USR1@180`, sent to the ranks only) the job requeues itself
# (`#SBATCH --requeue` allows it) and its rerun resumes from the run directory's checkpoint. When Slurm itself ends
# the job (SIGTERM here too) it is left to Slurm: a cancelled job stays cancelled, a preempted --requeue job is
# requeued by Slurm. Any other status ends the job as it is: 0 finished, 2 a user error, anything else a failure.
requeue_or_exit() {
    { set +x; } 2>/dev/null  # the submit scripts trace their srun line; this says what it does in words
    local status=$1
    if [ -e "$REQUEUE_MARKER" ]; then
        rm -f "$REQUEUE_MARKER"
        if [ "$status" != 0 ] && [ "$status" != 75 ]; then
            echo "srun's status is $status, but the ranks stopped with a checkpoint (exit 75; Slurm killed the ranks" \
                 "still ending after the first, --kill-on-bad-exit): taken as 75"
            status=75
        fi
    fi
    if [ "$status" = 75 ] && [ -n "${ended_by_slurm:-}" ]; then
        echo "stopped by a signal with a checkpoint, but Slurm is ending job $SLURM_JOB_ID ($ended_by_slurm to the" \
             "batch script: scancel, preemption or the time limit): not requeued; the same sbatch command resumes"
    elif [ "$status" = 75 ]; then
        echo "stopped by a signal with a checkpoint; requeueing job $SLURM_JOB_ID to resume"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    exit "$status"
}
