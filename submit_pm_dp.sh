#!/bin/bash
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -A dasrepo
#SBATCH --ntasks-per-node 4
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-node 4
#SBATCH --gpu-bind none
#SBATCH --time=01:00:00
#SBATCH --image=nersc/pytorch:24.08.01
#SBATCH --module=gpu,nccl-plugin
#SBATCH -J vit-era5
#SBATCH -o %x-%j.out
# Data parallel over whole nodes: 4 ranks a node, one per GPU, in the container (shifter). Submit from the
# repository root; every argument after the script name reaches the Python script unchanged.
#   sbatch -N 1 submit_pm_dp.sh --config=bs64_opt                        # 4 GPUs
#   sbatch -N 4 submit_pm_dp.sh --config=bs256_opt                       # 16 GPUs
#   sbatch -A ntrain4_g --reservation=dlscale_training_1 -N 4 submit_pm_dp.sh ...  # sbatch options win over #SBATCH
# Environment: as submit_pm.sh (TRAINING_SCRIPT [train.py], DATADIR, LOGDIR, IMAGE, ENABLE_PROFILING,
# PROFILE_OUTPUT, BENCHY_OUTPUT); README "Running on Perlmutter" lists them with their defaults.

TRAINING_SCRIPT=${TRAINING_SCRIPT:-train.py}
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
export FI_MR_CACHE_MONITOR=userfaultfd

# rank 0 runs on the first node of the allocation: the others meet it there (also from other nodes)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR

# Reversing order of GPUs to match default CPU affinities from Slurm (CUDA_VISIBLE_DEVICES set empty, i.e. no
# GPU, stays empty: the ranks then run on the CPU with gloo)
if [ -n "${CUDA_VISIBLE_DEVICES-unset}" ]; then
    export CUDA_VISIBLE_DEVICES=3,2,1,0
fi

command=(python "$TRAINING_SCRIPT" "$@")
# Profiling: nsys records the window the script opens with cudaProfilerStart/Stop (4th epoch by default);
# with several ranks each writes its own file (nsys fills in %q{SLURM_PROCID})
if [ "${ENABLE_PROFILING:-0}" = 1 ]; then
    echo "Enabling profiling..."
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

set -x
# the command travels as positional parameters of `bash -c` (never re-parsed: spaces and quotes survive)
# shellcheck disable=SC2016  # $@ is expanded by the inner bash, after export_DDP_vars.sh
srun -u shifter "${shifter_args[@]}" bash -c 'source export_DDP_vars.sh && exec "$@"' bash "${command[@]}"
