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
#   NNODES                 --dry-run on a login node: the nodes the job will have (its select=N;
#                          default 1), for the layout check and the printed command; in a job
#                          (PBS_NODEFILE) it may be set only to the job's node count
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
#   NCCL_OFI_PLUGIN_DIR    folder of the AWS OFI NCCL plugin (libnccl-net.so), NCCL's way onto the
#                          Slingshot network; default: a folder on LD_LIBRARY_PATH that holds it (a
#                          module's), else ALCF's newest install under /soft/libraries/aws-ofi-nccl;
#                          none: do without (NCCL then uses TCP sockets between nodes)
#   CPU_BIND               mpiexec --cpu-bind value under Cray PALS (default: each rank on the 8
#                          physical cores of the NUMA domain its GPU is attached to)
#   CUDA_VISIBLE_DEVICES   kept when set; default under PALS 3,2,1,0, so that local rank r's cuda:r
#                          is the GPU nearest its cores
#   PYTORCH_CUDA_ALLOC_CONF  PyTorch's CUDA allocator settings, kept when set (or when
#                          PYTORCH_ALLOC_CONF is); default expandable_segments:True
set -euo pipefail
ENV_AT_START=$(env | sort)  # what this script adds or changes is printed before the launch
# The walltime left is read from PBS now: exit_duration_mins counts from this moment, so that
# the recipe check, imports and model build before training are counted too.
export LAUNCH_START_EPOCH
LAUNCH_START_EPOCH=$(date +%s)
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # this header, as text
    sed -n '/^# Train on/,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0
fi
DRY_RUN=0
ARGS=()
for arg in "$@"; do  # --dry-run anywhere (after the recipe too): never a real launch by mistake
    if [[ "$arg" == "--dry-run" ]]; then DRY_RUN=1; else ARGS+=("$arg"); fi
done
set -- ${ARGS[@]+"${ARGS[@]}"}
cd "${PBS_O_WORKDIR:-$(dirname "$0")/..}"
if [[ ! -f pretrain.py ]]; then
    echo "error: $PWD is not the repository's root (no pretrain.py there): run qsub from the repository's root (PBS_O_WORKDIR=${PBS_O_WORKDIR:-unset})" >&2
    exit 2
fi
RECIPE="${RECIPE:-}"
# The first argument is the recipe unless it is an override (k=v) or an option (CHECK=1's).
if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then RECIPE="$1"; shift; fi
PROGRAM=pretrain.py
if [[ "${CHECK:-0}" == 1 ]]; then
    PROGRAM=tools/check_dist.py  # the recipe is optional: its layout's groups are checked
else
    [[ -n "$RECIPE" ]] || { echo "usage: launch/polaris.sh [--dry-run] RECIPE [overrides]   (--help: the settings)" >&2; exit 2; }
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
# A dry run on a login node (no PBS_NODEFILE) checks the layout for NNODES nodes, the job's
# select=N; a job counts its nodes in PBS_NODEFILE (an NNODES a job script exported must agree).
WANTED_NODES="${NNODES:-}"
[[ -z "$WANTED_NODES" || "$WANTED_NODES" =~ ^[1-9][0-9]*$ ]] || { echo "error: NNODES=$WANTED_NODES: give the nodes the job will have, a positive integer" >&2; exit 2; }
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
if [[ -n "$WANTED_NODES" && -z "$NODEFILE" && $DRY_RUN -eq 1 ]]; then
    NNODES="$WANTED_NODES"
elif [[ -n "$WANTED_NODES" && "$WANTED_NODES" != "$NNODES" ]]; then
    echo "error: NNODES=$WANTED_NODES, but this job has $NNODES node(s) (${NODEFILE:+the lines of PBS_NODEFILE=$NODEFILE}${NODEFILE:-no PBS_NODEFILE: this node}); NNODES is for a --dry-run on a login node: unset it" >&2
    exit 2
fi
PPN="${NGPUS_PER_NODE:-4}"
[[ "$PPN" =~ ^[1-9][0-9]*$ ]] || { echo "error: NGPUS_PER_NODE=$PPN: give the ranks per node, a positive integer" >&2; exit 2; }
NRANKS=$((NNODES * PPN))
MASTER_ADDR=$([[ -n "$NODEFILE" ]] && awk 'NF {print $1; exit}' "$NODEFILE" || hostname)
export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"

# NCCL reaches the Slingshot network through the AWS OFI (libfabric) plugin, with the settings
# ALCF's Polaris NCCL page gives (docs.alcf.anl.gov/polaris/applications-and-libraries/libraries/nccl/:
# the plugin under /soft/libraries/aws-ofi-nccl/VERSION/lib, put on LD_LIBRARY_PATH with its hwloc).
# NCCL_NET naming the plugin makes NCCL refuse to start when it cannot load it, so the plugin's
# settings are made only where its library is found. The same page reports hangs and NCCL
# timeouts with the plugin for some Megatron-DeepSpeed runs, and turns it off as
# NCCL_OFI_PLUGIN_DIR=none does here.
OFI_LIB=libnccl-net.so
ALCF_OFI_ROOT=/soft/libraries/aws-ofi-nccl
OFI_DIR=""
if [[ -n "${NCCL_OFI_PLUGIN_DIR:-}" && "$NCCL_OFI_PLUGIN_DIR" != none ]]; then
    [[ -f "$NCCL_OFI_PLUGIN_DIR/$OFI_LIB" ]] || { echo "error: NCCL_OFI_PLUGIN_DIR=$NCCL_OFI_PLUGIN_DIR has no $OFI_LIB: name the plugin's lib folder, or none to do without it" >&2; exit 2; }
    OFI_DIR="$NCCL_OFI_PLUGIN_DIR"
elif [[ -z "${NCCL_OFI_PLUGIN_DIR:-}" ]]; then
    IFS=: read -ra LIB_DIRS <<< "${LD_LIBRARY_PATH:-}"
    for dir in "${LIB_DIRS[@]}"; do
        if [[ -n "$dir" && -f "$dir/$OFI_LIB" ]]; then OFI_DIR="$dir"; break; fi
    done
    if [[ -z "$OFI_DIR" ]]; then
        shopt -s nullglob
        FOUND=("$ALCF_OFI_ROOT"/*/lib/"$OFI_LIB")
        shopt -u nullglob
        if [[ ${#FOUND[@]} -gt 0 ]]; then
            OFI_DIR=$(dirname "$(printf '%s\n' "${FOUND[@]}" | sort -V | tail -n 1)")
            [[ -d /soft/libraries/hwloc/lib ]] && export LD_LIBRARY_PATH="/soft/libraries/hwloc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
fi
NOT_FOUND="NCCL: no AWS OFI plugin ($OFI_LIB on LD_LIBRARY_PATH, under $ALCF_OFI_ROOT or in NCCL_OFI_PLUGIN_DIR)"
if [[ -n "$OFI_DIR" ]]; then
    [[ ":${LD_LIBRARY_PATH:-}:" == *":$OFI_DIR:"* ]] || export LD_LIBRARY_PATH="$OFI_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export NCCL_NET="${NCCL_NET:-AWS Libfabric}"  # the plugin, not TCP sockets
    export NCCL_NET_GDR_LEVEL=PHB          # GPU-direct RDMA when GPU and NIC share a PCIe host bridge
    export NCCL_CROSS_NIC=1                # rings may use different NICs on different nodes
    export NCCL_COLLNET_ENABLE=1           # in-network collectives where the fabric offers them
    NCCL_INFO="NCCL: AWS OFI plugin $OFI_DIR/$OFI_LIB (on LD_LIBRARY_PATH), NCCL_NET=$NCCL_NET"
elif [[ "${NCCL_OFI_PLUGIN_DIR:-}" == none ]]; then
    unset NCCL_NET NCCL_NET_GDR_LEVEL NCCL_CROSS_NIC NCCL_COLLNET_ENABLE
    NCCL_INFO="NCCL: AWS OFI plugin off (NCCL_OFI_PLUGIN_DIR=none), NCCL_NET unset: TCP sockets between nodes"
elif [[ -n "${NCCL_NET:-}" ]]; then
    NCCL_INFO="$NOT_FOUND: NCCL_NET=$NCCL_NET left as the environment sets it"
else
    NCCL_INFO="$NOT_FOUND: NCCL_NET not set, TCP sockets between nodes"
fi
export FI_CXI_DISABLE_HOST_REGISTER=1  # avoid libfabric host-memory registration hangs with CUDA
export FI_MR_CACHE_MONITOR=userfaultfd # a memory-registration cache monitor that works with CUDA
export FI_CXI_DEFAULT_CQ_SIZE=131072   # larger completion queues for collectives over many ranks

# Allocations whose sizes change from step to step (sequence packing, evaluation, pipeline
# buffers) fragment the caching allocator's fixed segments; expandable segments grow in place.
if [[ -n "${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
    ALLOC_INFO="allocator: PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF (the environment's)"
elif [[ -n "${PYTORCH_ALLOC_CONF:-}" ]]; then
    ALLOC_INFO="allocator: PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF (the environment's)"
else
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    ALLOC_INFO="allocator: PYTORCH_CUDA_ALLOC_CONF=$PYTORCH_CUDA_ALLOC_CONF"
fi

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
    "${PYTHON:-python}" pretrain.py "$RECIPE" "${OVERRIDES_ARR[@]}" --print-config \
        --world-size "$NRANKS" --gpus-per-node "$PPN" > /dev/null || exit 2
fi

FLAVOR="${MPI_FLAVOR:-}"
if [[ -z "$FLAVOR" ]]; then
    FLAVOR=pals
    # Read the whole banner before matching: under pipefail, `mpiexec --version | grep -q` fails
    # whenever grep exits first and mpiexec dies of SIGPIPE.
    MPI_VERSION=$(command -v mpiexec > /dev/null && mpiexec --version 2>&1 || true)
    if [[ "${MPI_VERSION,,}" == *hydra* ]]; then FLAVOR=hydra; fi
fi
if [[ "$FLAVOR" == hydra ]]; then  # MPICH's launcher (not Polaris): -genvall exports the env
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+-hostfile "$NODEFILE"} -genvall)
    PLACE_INFO="placement: none (Hydra; the core lists are for Polaris' Cray PALS)"
    GPU_INFO="GPUs: local rank r uses cuda:r${CUDA_VISIBLE_DEVICES:+ of CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}"
else
    # A Polaris node has one 32-core CPU (hardware threads 32-63 are the hyperthread siblings of
    # cores 0-31) in 4 NUMA domains of 8 cores, and GPU g is attached to NUMA domain 3-g (ALCF's
    # "Polaris Device Affinity Information", docs.alcf.anl.gov/polaris/hardware-overview/machine-overview/;
    # ALCF's set_affinity_gpu_polaris.sh gives local rank r GPU 3-r). Local rank r gets the
    # physical cores of domain r and sees the GPUs in reverse, so that the cuda:LOCAL_RANK the
    # trainer takes is the GPU of its own domain. More ranks than GPUs share the cores evenly.
    if [[ -z "${CPU_BIND:-}" ]]; then
        WIDTH=8
        ((PPN <= 4)) || WIDTH=$((32 / PPN > 0 ? 32 / PPN : 1))
        CPU_BIND=list
        for ((r = 0; r < PPN; r++)); do
            FIRST=$(((r * WIDTH) % 32))
            RANGE=$FIRST
            ((WIDTH == 1)) || RANGE+="-$((FIRST + WIDTH - 1))"
            CPU_BIND+=":$RANGE"
        done
        PLACE_INFO="placement: --cpu-bind $CPU_BIND (local rank r on the 8 physical cores of NUMA domain r)"
        ((PPN <= 4)) || PLACE_INFO="placement: --cpu-bind $CPU_BIND ($PPN ranks on 32 physical cores)"
    else
        PLACE_INFO="placement: --cpu-bind $CPU_BIND (CPU_BIND)"
    fi
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        GPU_INFO="GPUs: local rank r uses cuda:r of CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES (the environment's)"
    elif ((PPN <= 4)); then
        export CUDA_VISIBLE_DEVICES=3,2,1,0
        GPU_INFO="GPUs: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: local rank r's cuda:r is GPU 3-r, on the NUMA domain of its cores"
    else
        GPU_INFO="GPUs: $PPN ranks per node for 4 GPUs: CUDA_VISIBLE_DEVICES not set"
    fi
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+--hostfile "$NODEFILE"} --cpu-bind "$CPU_BIND" --envall)
fi
CMD=("${MPI[@]}" "${PYTHON:-python}" "$PROGRAM" ${RECIPE:+"$RECIPE"} "${OVERRIDES_ARR[@]}")

INFO="nodes: $NNODES × $PPN ranks, master $MASTER_ADDR:$MASTER_PORT, mpiexec flavor $FLAVOR"
[[ -n "$SIGNAL_AFTER_S" ]] && INFO+=", SIGUSR1 to mpiexec after ${SIGNAL_AFTER_S} s"
printf '%s\n' "$NCCL_INFO" "$PLACE_INFO" "$GPU_INFO" "$ALLOC_INFO" "$INFO"
echo "environment set for the ranks:"
comm -13 <(echo "$ENV_AT_START") <(env | sort) | grep -v -E '^(OLDPWD|PWD|SHLVL|_)=' | sed 's/^/  /'
QUOTED=$(printf '%q ' "${CMD[@]}")  # as a shell would need it: each argument's bounds visible
echo "${QUOTED% }"
[[ $DRY_RUN -eq 1 ]] && exit 0

"${CMD[@]}" &
MPI_PID=$!
# Signals sent to this script (qdel's SIGTERM, a manual SIGUSR1) go to the ranks through mpiexec.
trap 'kill -TERM "$MPI_PID" 2> /dev/null' TERM
trap 'kill -USR1 "$MPI_PID" 2> /dev/null' USR1
if [[ -n "$SIGNAL_AFTER_S" ]] && ((SIGNAL_AFTER_S > 0)); then
    # Counted, like the walltime, from this script's start (SECONDS), not from mpiexec's.
    (sleep "$((SIGNAL_AFTER_S > SECONDS ? SIGNAL_AFTER_S - SECONDS : 0))" && kill -USR1 "$MPI_PID" 2> /dev/null) &
    WATCHER=$!
fi
STATUS=0
while kill -0 "$MPI_PID" 2> /dev/null; do  # a trapped signal interrupts wait: wait again
    wait "$MPI_PID" && STATUS=0 || STATUS=$?
done
[[ -n "${WATCHER:-}" ]] && kill "$WATCHER" 2> /dev/null || true
exit "$STATUS"
