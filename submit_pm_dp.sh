#!/bin/bash
#SBATCH -C gpu
#SBATCH -q regular
#SBATCH -A dasrepo
#SBATCH --ntasks-per-node 4
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-node 4
#SBATCH --gpu-bind none
# (the original's: each rank sees the node's GPUs and takes cuda:LOCAL_RANK; no CPU/NIC map: docs/cluster.md)
#SBATCH --time=01:00:00
#SBATCH --signal=USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
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
# PROFILE_OUTPUT, BENCHY_OUTPUT); docs/cluster.md ("Environment variables") lists them with their defaults.
# Time limit: SIGUSR1 reaches every rank about 3 minutes before it; the ranks checkpoint and exit 75, and the job
# requeues itself and resumes there (docs/cluster.md, "Time limits, preemption and requeue").

TRAINING_SCRIPT=${TRAINING_SCRIPT:-train.py}
if [ ! -f submit_common.sh ]; then
    echo "error: submit_common.sh is not in $PWD; submit from the repository root (the job runs where sbatch ran)" >&2
    exit 2
fi
# the checks, DATADIR/LOGDIR, MASTER_ADDR and nsys (ENABLE_PROFILING=1) every submit script shares; it leaves the
# arrays `command` (python $TRAINING_SCRIPT "$@", maybe under nsys) and `shifter_args` (mounts, PYTHONUSERBASE,
# IMAGE), and requeue_or_exit for after srun
# shellcheck source=submit_common.sh
source ./submit_common.sh "$@"

# Reversing order of GPUs to match default CPU affinities from Slurm (CUDA_VISIBLE_DEVICES set empty, i.e. no
# GPU, stays empty: the ranks then run on the CPU with gloo)
if [ -n "${CUDA_VISIBLE_DEVICES-unset}" ]; then
    export CUDA_VISIBLE_DEVICES=3,2,1,0
fi

set -x
# the command travels as positional parameters of `bash -c` (never re-parsed: spaces and quotes survive)
# --kill-on-bad-exit=1: one rank's error ends every rank at once (not at NCCL's 10-minute timeout), its line last
# shellcheck disable=SC2016  # $@ is expanded by the inner bash, after export_DDP_vars.sh
srun -u --kill-on-bad-exit=1 shifter "${shifter_args[@]}" bash -c 'source export_DDP_vars.sh && exec "$@"' bash "${command[@]}"
# 75: stopped by the time-limit warning (--signal above) with a checkpoint: the job requeues itself and resumes
requeue_or_exit $?
