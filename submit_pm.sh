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
# Single GPU: sbatch submit_pm.sh --config=short
# Profile:    ENABLE_PROFILING=1 PROFILE_OUTPUT=baseline sbatch -n1 -t 20 submit_pm.sh --config=short
# Benchmark:  DATADIR=/path/to/cosmo BENCHY_OUTPUT=lowmem_2w sbatch -n1 submit_pm.sh --yaml_config config/UNet.yaml \
#                 --config=short --enable_benchy
#             (IO / SYNTHETIC / FULL samples/s, results in ./lowmem_2w.json)

DATADIR=${DATADIR:-/pscratch/sd/s/shas1693/data/dl-at-scale-training-data}
LOGDIR=${LOGDIR:-${SCRATCH}/dl-at-scale-training/logs}
mkdir -p ${LOGDIR}
args="${@}"

export HDF5_USE_FILE_LOCKING=FALSE
export FI_MR_CACHE_MONITOR=userfaultfd

# Profiling: nsys captures the window train.py opens with cudaProfilerStart/Stop (4th epoch by default)
if [ "${ENABLE_PROFILING:-0}" -eq 1 ]; then
    echo "Enabling profiling..."
    NSYS_ARGS="--trace=cuda,cublas,nvtx --kill none -c cudaProfilerApi -f true"
    NSYS_OUTPUT=${LOGDIR}/${PROFILE_OUTPUT:-profile}
    export PROFILE_CMD="nsys profile $NSYS_ARGS -o $NSYS_OUTPUT"
fi

export MASTER_ADDR=$(hostname)

set -x
srun -u shifter -V ${DATADIR}:/data -V ${LOGDIR}:/logs \
    bash -c "
    source export_DDP_vars.sh
    ${PROFILE_CMD} python train.py ${args}
    "
