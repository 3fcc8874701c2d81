#!/bin/bash
#SBATCH -C gpu
#SBATCH -q shared
#SBATCH -A dasrepo
#SBATCH --cpus-per-task 32
#SBATCH --gpus-per-task 1
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
# One to four GPUs of one node, one rank per GPU (-n, default 1), in the container (shifter). Submit from the
# repository root; every argument after the script name reaches the Python script unchanged.
#   sbatch submit_pm.sh --config=short                                    # 1 GPU
#   sbatch -q regular -n 4 submit_pm.sh --config=short                    # 4 GPUs: a whole node
#   sbatch -A ntrain4_g --reservation=dlscale_training_1 submit_pm.sh ... # sbatch options override the #SBATCH lines
# Four GPUs always with -q regular, SC21's -n 4 lines too (the shared QOS may take half a node: docs/cluster.md).
# No --ntasks-per-node (as the 2024 original): with `--ntasks-per-node 1`, Slurm would spread -n 4 over 4 nodes,
# which the shared QOS refuses. More than one node (-N 2, -n 8) is refused by the shared QOS at submission; with
# another QOS (-q regular) the job stops in one line naming the submit_pm_dp.sh command (4 ranks a node).
# Environment (defaults in brackets):
#   TRAINING_SCRIPT  train.py, train_graph.py, train_mp.py or train_mp_graphs.py [train.py]
#   DATADIR          data, mounted at /data [/pscratch/sd/s/shas1693/data/dl-at-scale-training-data]
#   LOGDIR           mounted at /logs; profiles and PYTHONUSERBASE go here [$SCRATCH/dl-at-scale-training/logs]
#   IMAGE            container image for shifter [the job's: #SBATCH --image, or sbatch --image=...]
#   ENABLE_PROFILING=1, PROFILE_OUTPUT=name   nsys writes $LOGDIR/name[_rank<N>].nsys-rep [profile]
#     ENABLE_PROFILING=1 PROFILE_OUTPUT=baseline sbatch -t 20 submit_pm.sh --config=short
#   BENCHY_OUTPUT=name   --enable_benchy results to name.json (relative: the submission directory)
#     BENCHY_OUTPUT=lowmem_2w sbatch submit_pm.sh --yaml_config config/UNet.yaml --config=short --enable_benchy
# Time limit: SIGUSR1 reaches every rank about 3 minutes before it; the ranks checkpoint and exit 75, and the job
# requeues itself and resumes there (docs/cluster.md, "Time limits, preemption and requeue").

# several nodes: the whole-node script's job (the shared QOS runs one node; SC21's submit_pm.sh took -N 2, -n 8)
if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ]; then
    same_args='' same_env=''
    if [ $# -gt 0 ]; then
        printf -v same_args ' %q' "$@"
    fi
    for name in TRAINING_SCRIPT ENABLE_PROFILING PROFILE_OUTPUT BENCHY_OUTPUT; do
        if [ -n "${!name:-}" ]; then
            same_env+="$name=$(printf '%q' "${!name}") "
        fi
    done
    echo "error: submit_pm.sh runs on one node, and this job has $SLURM_JOB_NUM_NODES ($SLURM_NTASKS tasks); for" \
         "$SLURM_JOB_NUM_NODES whole nodes, 4 ranks each, submit: ${same_env}sbatch -N $SLURM_JOB_NUM_NODES" \
         "submit_pm_dp.sh$same_args" >&2
    exit 2
fi

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

set -x
# the command travels as positional parameters of `bash -c` (never re-parsed: spaces and quotes survive)
# --kill-on-bad-exit=1: one rank's error ends every rank at once (not at NCCL's 10-minute timeout), its line last
# shellcheck disable=SC2016  # $@ is expanded by the inner bash, after export_DDP_vars.sh
srun -u --kill-on-bad-exit=1 shifter "${shifter_args[@]}" bash -c 'source export_DDP_vars.sh && exec "$@"' bash "${command[@]}"
# 75: stopped by the time-limit warning (--signal above) with a checkpoint: the job requeues itself and resumes
requeue_or_exit $?
