#!/bin/bash
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -q debug-scaling
#PBS -A YOUR_PROJECT
#PBS -j oe
# Train on ALCF Polaris (4 × A100 per node) with mpiexec, one rank per GPU.
#
#   qsub -A PROJECT -v RECIPE=recipes/gpt2-124m.yaml,OVERRIDES="training.iters=100" launch/polaris.sh
#   qsub -A PROJECT -v RECIPE=recipes/gpt2-124m.yaml,OVERRIDES_FILE=$PWD/my.overrides launch/polaris.sh
#   launch/polaris.sh RECIPE [overrides]            # inside an interactive job (qsub -I ...)
#   launch/polaris.sh --dry-run RECIPE [overrides]  # check the recipe and overrides, print the
#                                                   # environment and command (before qsub)
#   CHECK=1 launch/polaris.sh [RECIPE [overrides]]  # check ranks, groups and network first
#                                                   # (tools/check_dist.py instead of training)
#
# Any #PBS line above can be overridden on the qsub command line (-l select=8:system=polaris,
# -l walltime=06:00:00, -q prod, -A PROJECT, -l filesystems=home:grand).
#
# Settings (environment):
#   NGPUS_PER_NODE         ranks per node (default 4, the A100s of a Polaris node)
#   PYTHON                 the interpreter to run (default: python from the active environment)
#   MPI_FLAVOR             pals (Polaris' Cray mpiexec) or hydra (MPICH); detected by default
#   OVERRIDES              overrides when none are given as arguments, separated by spaces and
#                          quoted as in a shell ('training.sample_prompt="Once upon a time"');
#                          qsub -v splits its list at commas, so a value with a comma
#                          (data.split=969,30,1) goes in OVERRIDES_FILE instead
#   OVERRIDES_FILE         a file of overrides, one per line, taken as written (# comments skipped)
#   WALLTIME               HH:MM:SS the job has left; default: the job's Resource_List.walltime
#                          minus its resources_used.walltime from qstat (in an interactive job the
#                          time already spent in it counts)
#   CHECKPOINT_MARGIN_MIN  minutes before walltime at which the run saves and exits (default 10)
set -euo pipefail
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
cd "${PBS_O_WORKDIR:-$(dirname "$0")/..}"
RECIPE="${RECIPE:-}"
# The first argument is the recipe unless it is an override (k=v) or an option (CHECK=1's).
if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then RECIPE="$1"; shift; fi
PROGRAM=pretrain.py
if [[ "${CHECK:-0}" == 1 ]]; then
    PROGRAM=tools/check_dist.py  # the recipe is optional: its layout's groups are checked
else
    [[ -n "$RECIPE" ]] || { echo "usage: launch/polaris.sh [--dry-run] RECIPE [overrides]" >&2; exit 2; }
fi
OVERRIDES_ARR=("$@")
if [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${OVERRIDES_FILE:-}" ]]; then
    [[ -f "$OVERRIDES_FILE" ]] || { echo "error: OVERRIDES_FILE=$OVERRIDES_FILE does not exist" >&2; exit 2; }
    while IFS= read -r line || [[ -n "$line" ]]; do
        line="${line#"${line%%[![:space:]]*}"}"; line="${line%"${line##*[![:space:]]}"}"
        [[ -z "$line" || "$line" == \#* ]] || OVERRIDES_ARR+=("$line")
    done < "$OVERRIDES_FILE"
elif [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${OVERRIDES:-}" ]]; then
    # Shell quoting rules without a shell's expansions (no eval): a quoted value keeps its spaces.
    # A process substitution's failure does not stop the script by itself: `wait $!` collects
    # its status, so an OVERRIDES that cannot be split stops the job instead of training the
    # recipe without the overrides.
    mapfile -d '' -t OVERRIDES_ARR < <("${PYTHON:-python}" -c '
import shlex, sys
try:
    words = shlex.split(sys.argv[1])
except ValueError as e:
    sys.stderr.write(f"error: OVERRIDES={sys.argv[1]!r} cannot be split as a shell splits it ({e}): "
                     "balance its quotes, or put the overrides in OVERRIDES_FILE, one per line\n")
    sys.exit(2)
sys.stdout.write("".join(w + "\0" for w in words))' "$OVERRIDES")
    wait $! || exit 2
fi

NODEFILE="${PBS_NODEFILE:-}"
if [[ -n "$NODEFILE" && ! -f "$NODEFILE" ]]; then echo "error: PBS_NODEFILE=$NODEFILE does not exist" >&2; exit 2; fi
NNODES=1
if [[ -n "$NODEFILE" ]]; then
    # grep -c prints 0 and fails when no line matches: its count is the answer either way (a
    # fallback after || would append a second number).
    NNODES=$(sort -u "$NODEFILE" | grep -c .) || true
    if [[ "$NNODES" == 0 || -z "$NNODES" ]]; then
        echo "error: PBS_NODEFILE=$NODEFILE names no node: give a file of host names, one per line, or leave PBS_NODEFILE unset for this node alone" >&2
        exit 2
    fi
fi
PPN="${NGPUS_PER_NODE:-4}"
[[ "$PPN" =~ ^[1-9][0-9]*$ ]] || { echo "error: NGPUS_PER_NODE=$PPN: give the ranks per node, a positive integer" >&2; exit 2; }
NRANKS=$((NNODES * PPN))
MASTER_ADDR=$([[ -n "$NODEFILE" ]] && awk 'NF {print $1; exit}' "$NODEFILE" || hostname)
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"

# NCCL over the Slingshot network through the AWS OFI (libfabric) plugin, as ALCF documents for
# PyTorch on Polaris.
export NCCL_NET_GDR_LEVEL=PHB          # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
export NCCL_CROSS_NIC=1                # rings may use different NICs on different nodes
export NCCL_COLLNET_ENABLE=1           # in-network collectives where the fabric offers them
export NCCL_NET="AWS Libfabric"        # use the OFI plugin, not TCP sockets
export FI_CXI_DISABLE_HOST_REGISTER=1  # avoid libfabric host-memory registration hangs with CUDA
export FI_MR_CACHE_MONITOR=userfaultfd # a memory-registration cache monitor that works with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072   # larger completion queues for collectives over many ranks

# Stop in time to checkpoint: PBS Pro cannot signal a job before its walltime, so this script
# does. It sets training.exit_duration_mins (the trainer saves and exits 0 that long after its
# start) and, as a second line, sends SIGUSR1 to mpiexec (which forwards it to the ranks; the
# trainer saves and exits on it, checkpoint.save_on_signal) CHECKPOINT_MARGIN_MIN before walltime.
MARGIN_MIN="${CHECKPOINT_MARGIN_MIN:-10}"
WALLTIME="${WALLTIME:-}"
seconds() {  # HH:MM:SS -> seconds (empty when it is not that)
    [[ "$1" =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]] || return 0
    echo $((10#${BASH_REMATCH[1]} * 3600 + 10#${BASH_REMATCH[2]} * 60 + 10#${BASH_REMATCH[3]}))
}
LEFT_S=$(seconds "$WALLTIME")
if [[ -z "$WALLTIME" && -n "${PBS_JOBID:-}" ]] && command -v qstat > /dev/null; then
    QSTAT=$(qstat -f "$PBS_JOBID" 2> /dev/null || true)
    LIMIT_S=$(seconds "$(awk '/Resource_List.walltime/ {print $3}' <<< "$QSTAT")")
    USED_S=$(seconds "$(awk '/resources_used.walltime/ {print $3}' <<< "$QSTAT")")
    [[ -n "$LIMIT_S" ]] && LEFT_S=$((LIMIT_S - ${USED_S:-0}))
fi
SIGNAL_AFTER_S=""
if [[ -n "$LEFT_S" ]]; then
    SIGNAL_AFTER_S=$((LEFT_S - MARGIN_MIN * 60))
    if ((SIGNAL_AFTER_S > 0)) && [[ " ${OVERRIDES_ARR[*]:-} " != *" training.exit_duration_mins="* ]]; then
        OVERRIDES_ARR+=("training.exit_duration_mins=$((SIGNAL_AFTER_S / 60))")
    fi
fi

# The recipe and overrides are checked here, once, before mpiexec starts a rank: a typo found
# by every rank after the job has waited in the queue would cost the allocation (and the
# launch a traceback per rank). `--dry-run` before qsub runs the same check without a job.
if [[ "$PROGRAM" == pretrain.py ]]; then
    "${PYTHON:-python}" pretrain.py "$RECIPE" "${OVERRIDES_ARR[@]}" --print-config > /dev/null || exit 2
fi

FLAVOR="${MPI_FLAVOR:-}"
if [[ -z "$FLAVOR" ]]; then
    FLAVOR=pals
    # Read the whole banner before matching: under pipefail, `mpiexec --version | grep -q` fails
    # whenever grep exits first and mpiexec dies of SIGPIPE.
    MPI_VERSION=$(command -v mpiexec > /dev/null && mpiexec --version 2>&1 || true)
    if [[ "${MPI_VERSION,,}" == *hydra* ]]; then FLAVOR=hydra; fi
fi
if [[ "$FLAVOR" == hydra ]]; then  # MPICH's launcher: no depth binding, -genvall exports the env
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+-hostfile "$NODEFILE"} -genvall)
else                               # Cray PALS: 16 cores (of 64) per rank, bound by depth
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+--hostfile "$NODEFILE"} --cpu-bind depth -d 16 --envall)
fi
CMD=("${MPI[@]}" "${PYTHON:-python}" "$PROGRAM" ${RECIPE:+"$RECIPE"} "${OVERRIDES_ARR[@]}")

INFO="nodes: $NNODES × $PPN ranks, master $MASTER_ADDR:$MASTER_PORT, mpiexec flavor $FLAVOR"
[[ -n "$SIGNAL_AFTER_S" ]] && INFO+=", SIGUSR1 to mpiexec after ${SIGNAL_AFTER_S} s"
echo "$INFO"
QUOTED=$(printf '%q ' "${CMD[@]}")  # as a shell would need it: each argument's bounds visible
echo "${QUOTED% }"
[[ $DRY_RUN -eq 1 ]] && exit 0

"${CMD[@]}" &
MPI_PID=$!
# Signals sent to this script (qdel's SIGTERM, a manual SIGUSR1) go to the ranks through mpiexec.
trap 'kill -TERM "$MPI_PID" 2> /dev/null' TERM
trap 'kill -USR1 "$MPI_PID" 2> /dev/null' USR1
if [[ -n "$SIGNAL_AFTER_S" ]] && ((SIGNAL_AFTER_S > 0)); then
    (sleep "$SIGNAL_AFTER_S" && kill -USR1 "$MPI_PID" 2> /dev/null) &
    WATCHER=$!
fi
STATUS=0
while kill -0 "$MPI_PID" 2> /dev/null; do  # a trapped signal interrupts wait: wait again
    wait "$MPI_PID" && STATUS=0 || STATUS=$?
done
[[ -n "${WATCHER:-}" ]] && kill "$WATCHER" 2> /dev/null || true
exit "$STATUS"
