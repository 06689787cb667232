#!/bin/bash
# Train on Intel Gaudi nodes (8 HPUs each): HCCL collectives, DeepSpeed's HPU accelerator.
#
#   launch/gaudi.sh RECIPE [overrides]                       # one node, all 8 HPUs
#   HPUS_PER_NODE=4 launch/gaudi.sh RECIPE [overrides]       # 4 of them
#   HOSTFILE=hosts launch/gaudi.sh RECIPE                    # several nodes ("host slots=8" lines)
#   LAUNCHER=mpirun HOSTFILE=hosts launch/gaudi.sh RECIPE    # Open MPI's mpirun instead
#   launch/gaudi.sh --dry-run RECIPE [overrides]             # check the recipe, print what would run
#
# The execution mode comes from the recipe (training.hpu_mode): lazy graph mode sets
# PT_HPU_LAZY_MODE=1; eager and compile (eager + torch.compile on the HPU backend) set 0.
# Settings (environment): HPUS_PER_NODE (default 8), HOSTFILE, LAUNCHER (deepspeed | mpirun),
# HABANA_VISIBLE_MODULES (default: the first HPUS_PER_NODE modules), PYTHON, MASTER_PORT.
# PT_HPU_*, HABANA_* and HCCL_* variables of this shell reach every node (DeepSpeed launcher:
# through a generated DS_ENV_FILE that keeps your ~/.deepspeed_env lines; mpirun: -x). That file
# may hold secrets (API keys): it is private (mktemp, mode 0600), written only for a real launch
# and removed when this script exits.
set -euo pipefail
USAGE="usage: launch/gaudi.sh [--dry-run] RECIPE [overrides]   (--help: the settings)"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # this header, as text
    sed -n '/^# Train on/,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
DRY_RUN=0
ARGS=()
for arg in "$@"; do  # --dry-run anywhere (after the recipe too): never a real launch by mistake
    if [[ "$arg" == "--dry-run" ]]; then DRY_RUN=1; else ARGS+=("$arg"); fi
done
set -- ${ARGS[@]+"${ARGS[@]}"}
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { echo "$USAGE" >&2; exit 2; }
[[ "$1" != -* ]] || { echo "error: unknown option $1; $USAGE" >&2; exit 2; }
RECIPE="$1"; shift
PYTHON="${PYTHON:-python}"
HPUS="${HPUS_PER_NODE:-8}"
[[ "$HPUS" =~ ^[1-9][0-9]*$ ]] || { echo "error: HPUS_PER_NODE=$HPUS: give the HPUs per node, a positive integer" >&2; exit 2; }
if [[ -n "${HOSTFILE:-}" && ! -f "$HOSTFILE" ]]; then
    echo "error: HOSTFILE=$HOSTFILE does not exist: give a file of \"host slots=N\" lines, or leave HOSTFILE unset for this node alone" >&2
    exit 2
fi
# A host line is one that is neither blank nor a comment, as both launchers read the file.
HOST_LINE='^[[:space:]]*[^#[:space:]]'
if [[ -n "${HOSTFILE:-}" ]] && ! grep -q "$HOST_LINE" "$HOSTFILE"; then
    echo "error: HOSTFILE=$HOSTFILE names no host: give a file of \"host slots=N\" lines, or leave HOSTFILE unset for this node alone" >&2
    exit 2
fi

NNODES=1
[[ -n "${HOSTFILE:-}" ]] && NNODES=$(grep -c "$HOST_LINE" "$HOSTFILE")  # at least 1: checked above
# Every node runs HPUS_PER_NODE ranks (mpirun's ppr, DeepSpeed's --num_gpus): a host whose slots
# say otherwise would get another count than the layout is checked for.
if [[ -n "${HOSTFILE:-}" ]]; then
    OTHER=$(awk -v n="$HPUS" 'NF && $1 !~ /^#/ { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/ && substr($i, 7) != n) { print; exit } }' "$HOSTFILE")
    if [[ -n "$OTHER" ]]; then
        echo "error: HOSTFILE=$HOSTFILE line '$OTHER' does not say slots=$HPUS: every node runs HPUS_PER_NODE=$HPUS ranks; make the two agree" >&2
        exit 2
    fi
fi
# The recipe, and its layout for the ranks this job starts, before any starts.
MODE=$("$PYTHON" pretrain.py "$RECIPE" "$@" --get training.hpu_mode \
       --world-size $((NNODES * HPUS)) --gpus-per-node "$HPUS") || exit 2
case "$MODE" in
    lazy) LAZY=1 ;;
    eager | compile) LAZY=0 ;;
    *) echo "error: cannot read training.hpu_mode from $RECIPE (got '$MODE')" >&2; exit 2 ;;
esac
export PT_HPU_LAZY_MODE="$LAZY"
export HABANA_VISIBLE_MODULES="${HABANA_VISIBLE_MODULES:-$(seq -s, 0 $((HPUS - 1)))}"
export DS_ACCELERATOR=hpu
MASTER_ADDR="${MASTER_ADDR:-$([[ -n "${HOSTFILE:-}" ]] && awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE" || hostname)}"
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"

ARGS=(pretrain.py "$RECIPE" training.device=hpu "$@")
# What the ranks on other nodes must see: the execution mode, the modules, the accelerator, and
# any Habana/HCCL setting of this shell. Neither launcher forwards them by itself.
FORWARD=(PT_HPU_LAZY_MODE HABANA_VISIBLE_MODULES DS_ACCELERATOR)
while read -r name; do
    [[ " ${FORWARD[*]} " == *" $name "* ]] || FORWARD+=("$name")
done < <(compgen -e | grep -E '^(PT_HPU_|HABANA_|HCCL_|PT_HABANA)' | sort)
USER_ENV_FILES=()  # the DeepSpeed launcher's: copied into its env file at launch
case "${LAUNCHER:-deepspeed}" in
    deepspeed)
        # The DeepSpeed launcher exports to remote nodes only the KEY=VALUE lines of its env file
        # (~/.deepspeed_env and ./.deepspeed_env, or DS_ENV_FILE): at launch, a copy with the
        # user's lines and ours goes where DS_ENV_FILE points (below).
        USER_ENV_FILES=("$HOME/.deepspeed_env" ./.deepspeed_env)
        [[ -n "${DS_ENV_FILE:-}" ]] && USER_ENV_FILES=("$DS_ENV_FILE")
        CMD=(deepspeed --num_gpus "$HPUS" ${HOSTFILE:+--hostfile "$HOSTFILE"} --master_addr "$MASTER_ADDR"
             --master_port "$MASTER_PORT" "${ARGS[@]}") ;;
    mpirun)
        EXPORTS=()
        for name in "${FORWARD[@]}" MASTER_ADDR MASTER_PORT; do EXPORTS+=(-x "$name"); done
        CMD=(mpirun -n $((NNODES * HPUS)) --map-by "ppr:$HPUS:node" --bind-to none
             ${HOSTFILE:+--hostfile "$HOSTFILE"} "${EXPORTS[@]}" "$PYTHON" "${ARGS[@]}") ;;
    *) echo "error: LAUNCHER=$LAUNCHER: use deepspeed or mpirun" >&2; exit 2 ;;
esac

if [[ ${#USER_ENV_FILES[@]} -gt 0 ]]; then  # names only: the user's file may hold secrets
    echo "DS_ENV_FILE (a private copy, written at launch): the lines of ${USER_ENV_FILES[*]}; ${FORWARD[*]}"
fi
echo "training.hpu_mode=$MODE PT_HPU_LAZY_MODE=$PT_HPU_LAZY_MODE HABANA_VISIBLE_MODULES=$HABANA_VISIBLE_MODULES" \
     "DS_ACCELERATOR=$DS_ACCELERATOR MASTER_ADDR=$MASTER_ADDR"
echo "${CMD[@]}"
[[ $DRY_RUN -eq 1 ]] && exit 0
[[ ${#USER_ENV_FILES[@]} -eq 0 ]] && exec "${CMD[@]}"

# mktemp: an unpredictable name, created 0600 (the user's lines may be API keys). The trap
# removes it however this script ends; DeepSpeed's runner has read it by then.
ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/megatron_lite_deepspeed_env.XXXXXX")
trap 'rm -f "$ENV_FILE"' EXIT
{
    for f in "${USER_ENV_FILES[@]}"; do
        if [[ -r "$f" ]]; then awk 1 "$f"; fi  # awk 1: a last line without its newline still ends
    done
    for name in "${FORWARD[@]}"; do echo "$name=${!name}"; done
} | { grep . || true; } > "$ENV_FILE"
export DS_ENV_FILE="$ENV_FILE"
# Not exec (the trap must outlive the launcher): signals sent to this script go on to it.
"${CMD[@]}" &
LAUNCHER_PID=$!
for sig in TERM INT HUP USR1 USR2; do
    # shellcheck disable=SC2064  # the signal's name is fixed now, the pid read when it fires
    trap "kill -$sig \"\$LAUNCHER_PID\" 2> /dev/null" "$sig"
done
while :; do
    wait "$LAUNCHER_PID" && STATUS=0 || STATUS=$?
    kill -0 "$LAUNCHER_PID" 2> /dev/null || break  # a trapped signal interrupted wait: wait again
done
exit "$STATUS"
