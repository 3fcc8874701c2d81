# Source inside `srun` so each task exports what torch.distributed (and torchrun) use:
# RANK, LOCAL_RANK, WORLD_SIZE from Slurm; MASTER_ADDR is exported by the submit script.
export RANK=$SLURM_PROCID
export LOCAL_RANK=$SLURM_LOCALID
export WORLD_SIZE=$SLURM_NTASKS
export MASTER_PORT=29500 # default from torch launcher
