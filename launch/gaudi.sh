#!/bin/bash
# Train on Intel Gaudi nodes (8 HPUs each): HCCL collectives, DeepSpeed's HPU accelerator.
#
#   launch/gaudi.sh RECIPE [overrides]                       # one node, all 8 HPUs
#   HPUS_PER_NODE=4 launch/gaudi.sh RECIPE [overrides]       # 4 of them
#   HOSTFILE=hosts launch/gaudi.sh RECIPE                    # several nodes ("host slots=8" lines)
#   LAUNCHER=mpirun HOSTFILE=hosts launch/gaudi.sh RECIPE    # Open MPI's mpirun instead
#   launch/gaudi.sh --dry-run RECIPE [overrides]             # print the environment and command only
#
# The execution mode comes from the recipe (training.hpu_mode): lazy graph mode sets
# PT_HPU_LAZY_MODE=1; eager and compile (eager + torch.compile on the HPU backend) set 0.
# Settings (environment): HPUS_PER_NODE (default 8), HOSTFILE, LAUNCHER (deepspeed | mpirun),
# HABANA_VISIBLE_MODULES (default: the first HPUS_PER_NODE modules), PYTHON, MASTER_PORT.
# PT_HPU_*, HABANA_* and HCCL_* variables of this shell reach every node (DeepSpeed launcher:
# through a generated DS_ENV_FILE that keeps your ~/.deepspeed_env lines; mpirun: -x).
set -euo pipefail
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
cd "$(dirname "$0")/.."
RECIPE="${1:?usage: launch/gaudi.sh [--dry-run] RECIPE [overrides]}"; shift
PYTHON="${PYTHON:-python}"

MODE=$("$PYTHON" pretrain.py "$RECIPE" "$@" --get training.hpu_mode)
case "$MODE" in
    lazy) LAZY=1 ;;
    eager | compile) LAZY=0 ;;
    *) echo "error: cannot read training.hpu_mode from $RECIPE (got '$MODE')" >&2; exit 2 ;;
esac
HPUS="${HPUS_PER_NODE:-8}"
export PT_HPU_LAZY_MODE="$LAZY"
export HABANA_VISIBLE_MODULES="${HABANA_VISIBLE_MODULES:-$(seq -s, 0 $((HPUS - 1)))}"
export DS_ACCELERATOR=hpu
MASTER_ADDR="${MASTER_ADDR:-$([[ -n "${HOSTFILE:-}" ]] && awk 'NF {print $1; exit}' "$HOSTFILE" || hostname)}"
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"

ARGS=(pretrain.py "$RECIPE" training.device=hpu "$@")
# What the ranks on other nodes must see: the execution mode, the modules, the accelerator, and
# any Habana/HCCL setting of this shell. Neither launcher forwards them by itself.
FORWARD=(PT_HPU_LAZY_MODE HABANA_VISIBLE_MODULES DS_ACCELERATOR)
while read -r name; do
    [[ " ${FORWARD[*]} " == *" $name "* ]] || FORWARD+=("$name")
done < <(compgen -e | grep -E '^(PT_HPU_|HABANA_|HCCL_|PT_HABANA)' | sort)
case "${LAUNCHER:-deepspeed}" in
    deepspeed)
        # The DeepSpeed launcher exports to remote nodes only the KEY=VALUE lines of its env file
        # (~/.deepspeed_env and ./.deepspeed_env, or DS_ENV_FILE): write one with the user's
        # lines and ours, and point DS_ENV_FILE at it.
        ENV_FILE="${TMPDIR:-/tmp}/megatron_lite_deepspeed_env.$$"
        {
            if [[ -n "${DS_ENV_FILE:-}" ]]; then cat "$DS_ENV_FILE" 2> /dev/null || true
            else cat "$HOME/.deepspeed_env" ./.deepspeed_env 2> /dev/null || true; fi
            for name in "${FORWARD[@]}"; do echo "$name=${!name}"; done
        } | grep . > "$ENV_FILE" || true
        export DS_ENV_FILE="$ENV_FILE"
        CMD=(deepspeed --num_gpus "$HPUS" ${HOSTFILE:+--hostfile "$HOSTFILE"} --master_addr "$MASTER_ADDR"
             --master_port "$MASTER_PORT" "${ARGS[@]}") ;;
    mpirun)
        NNODES=$([[ -n "${HOSTFILE:-}" ]] && grep -c . "$HOSTFILE" || echo 1)
        EXPORTS=()
        for name in "${FORWARD[@]}" MASTER_ADDR MASTER_PORT; do EXPORTS+=(-x "$name"); done
        CMD=(mpirun -n $((NNODES * HPUS)) --map-by "ppr:$HPUS:node" --bind-to none
             ${HOSTFILE:+--hostfile "$HOSTFILE"} "${EXPORTS[@]}" "$PYTHON" "${ARGS[@]}") ;;
    *) echo "error: LAUNCHER=$LAUNCHER: use deepspeed or mpirun" >&2; exit 2 ;;
esac

echo "training.hpu_mode=$MODE PT_HPU_LAZY_MODE=$PT_HPU_LAZY_MODE HABANA_VISIBLE_MODULES=$HABANA_VISIBLE_MODULES" \
     "DS_ACCELERATOR=$DS_ACCELERATOR MASTER_ADDR=$MASTER_ADDR${ENV_FILE:+ DS_ENV_FILE=$ENV_FILE}"
echo "${CMD[@]}"
[[ $DRY_RUN -eq 1 ]] && exit 0
exec "${CMD[@]}"
