#!/bin/bash
#SBATCH -C gpu
#SBATCH -q shared
#SBATCH -A dasrepo
#SBATCH --ntasks-per-node 1
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-task 1
#SBATCH --gpu-bind none
#SBATCH --time=01:00:00
#SBATCH --image=nersc/pytorch:24.08.01
#SBATCH --module=gpu,nccl-plugin
#SBATCH -J vit-era5
#SBATCH -o %x-%j.out
# One or a few GPUs of one node, one rank per GPU, in the container (shifter). Submit from the repository root;
# every argument after the script name reaches the Python script unchanged.
#   sbatch submit_pm.sh --config=short                                    # 1 GPU
#   sbatch --ntasks-per-node 4 submit_pm.sh --config=short                # 4 GPUs of one node
#   sbatch -A ntrain4_g --reservation=dlscale_training_1 submit_pm.sh ... # sbatch options override the #SBATCH lines
# Environment (defaults in brackets):
#   TRAINING_SCRIPT  train.py, train_graph.py, train_mp.py or train_mp_graphs.py [train.py]
#   DATADIR          data, mounted at /data [/pscratch/sd/s/shas1693/data/dl-at-scale-training-data]
#   LOGDIR           mounted at /logs; profiles go here [$SCRATCH/dl-at-scale-training/logs]
#   IMAGE            container image for shifter [the job's: #SBATCH --image, or sbatch --image=...]
#   ENABLE_PROFILING=1, PROFILE_OUTPUT=name   nsys writes $LOGDIR/name[_rank<N>].nsys-rep [profile]
#     ENABLE_PROFILING=1 PROFILE_OUTPUT=baseline sbatch -t 20 submit_pm.sh --config=short
#   BENCHY_OUTPUT=name   --enable_benchy results to name.json (relative: the submission directory)
#     BENCHY_OUTPUT=lowmem_2w sbatch submit_pm.sh --yaml_config config/UNet.yaml --config=short --enable_benchy

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
