#!/bin/bash
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug-scaling
#PBS -A YOUR_PROJECT
# Train on ALCF Polaris (4×A100 per node) with mpiexec, one rank per GPU.
#   RECIPE=recipes/gpt2-124m.yaml OVERRIDES="training.iters=100" qsub launch/polaris.sh
#   launch/polaris.sh recipes/gpt2-124m.yaml training.iters=100     # inside an interactive job
#   launch/polaris.sh --dry-run recipes/gpt2-124m.yaml              # print the command only
set -euo pipefail
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/..}"
RECIPE="${1:-${RECIPE:-}}"
[[ -n "$RECIPE" ]] || { echo "usage: launch/polaris.sh [--dry-run] RECIPE [overrides]" >&2; exit 2; }
shift || true
OVERRIDES_ARR=("$@")
if [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${OVERRIDES:-}" ]]; then read -r -a OVERRIDES_ARR <<< "$OVERRIDES"; fi

NODEFILE="${PBS_NODEFILE:-}"
NNODES=$([[ -n "$NODEFILE" && -f "$NODEFILE" ]] && sort -u "$NODEFILE" | wc -l || echo 1)
PPN=4
NRANKS=$((NNODES * PPN))
MASTER_ADDR=$([[ -n "$NODEFILE" && -f "$NODEFILE" ]] && head -n 1 "$NODEFILE" || hostname)
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
# NCCL over Slingshot via the AWS OFI plugin, as ALCF documents for PyTorch on Polaris.
export NCCL_NET_GDR_LEVEL=PHB        # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1              # rings may cross NICs (Polaris nodes have several)
export NCCL_COLLNET_ENABLE=1
export NCCL_NET="AWS Libfabric"      # use the OFI plugin rather than sockets
export FI_CXI_DISABLE_HOST_REGISTER=1  # avoid libfabric host-memory registration hangs
export FI_MR_CACHE_MONITOR=userfaultfd # memory-registration cache monitor that works with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072   # larger completion queues for many-rank collectives
CMD=(mpiexec -n "$NRANKS" -ppn "$PPN" --cpu-bind depth -d 16 --envall
     ${NODEFILE:+--hostfile "$NODEFILE"} python pretrain.py "$RECIPE" "${OVERRIDES_ARR[@]}")
echo "${CMD[@]}"
[[ $DRY_RUN -eq 1 ]] && exit 0
exec "${CMD[@]}"
