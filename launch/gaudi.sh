#!/bin/bash
# Train on Intel Gaudi nodes (8 HPUs each) with the DeepSpeed launcher.
#   launch/gaudi.sh RECIPE [overrides]                 # one node, all HPUs
#   HOSTFILE=hosts launch/gaudi.sh RECIPE [overrides]  # several nodes ("host slots=8" lines)
#   launch/gaudi.sh --dry-run RECIPE                   # print the command only
set -euo pipefail
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
cd "$(dirname "$0")/.."
RECIPE="${1:?usage: launch/gaudi.sh [--dry-run] RECIPE [overrides]}"; shift
export PT_HPU_LAZY_MODE="${PT_HPU_LAZY_MODE:-1}"   # 1 lazy graph mode, 0 eager
export DS_ACCELERATOR=hpu
CMD=(deepspeed --num_gpus "${HPUS_PER_NODE:-8}" ${HOSTFILE:+--hostfile "$HOSTFILE"}
     pretrain.py "$RECIPE" training.device=hpu "$@")
echo "${CMD[@]}"
[[ $DRY_RUN -eq 1 ]] && exit 0
exec "${CMD[@]}"
