# shellcheck shell=bash
# Source inside `srun` (the submit scripts do, in the container) so that each task exports the names torch.distributed
# and torchrun use, from Slurm's: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT. MASTER_ADDR comes from the submit
# script (the first node of the allocation). Nothing here picks a device: utils/comm.py takes the GPU LOCAL_RANK
# when CUDA is present (NCCL), else the CPU (gloo).
if [ -z "${SLURM_PROCID:-}" ]; then
    echo "error: SLURM_PROCID is not set; source export_DDP_vars.sh inside srun (or use torchrun, which sets RANK)" >&2
    # shellcheck disable=SC2317  # exit only when run instead of sourced
    return 2 2>/dev/null || exit 2
fi
export RANK=$SLURM_PROCID
export LOCAL_RANK=$SLURM_LOCALID
export WORLD_SIZE=$SLURM_NTASKS
# torch's launcher default is 29500; one port per job instead (29500-30499), so that two jobs sharing a node
# (qos shared) do not both listen on it. A MASTER_PORT already set wins.
export MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
