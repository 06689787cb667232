#!/bin/bash
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:flare
#PBS -q debug
#PBS -A YOUR_PROJECT
#PBS -j oe
# Train on ALCF Aurora (6 Intel Data Center GPU Max 1550 per node, 12 tiles) with mpiexec, one
# rank per tile, collectives over oneCCL (training.device=xpu).
#
#   qsub -A PROJECT -v RECIPE=recipes/llama2-7b-aurora.yaml launch/aurora.sh
#   qsub -A PROJECT -v RECIPE=recipes/llama2-7b-aurora.yaml,CHAIN=16 -l walltime=06:00:00 launch/aurora.sh
#   launch/aurora.sh RECIPE [overrides]            # inside an interactive job (qsub -I ...)
#   launch/aurora.sh --dry-run RECIPE [overrides]  # check the recipe and overrides, print the
#                                                  # environment and command (before qsub)
#   CHECK=1 launch/aurora.sh [RECIPE [overrides]]  # check ranks, groups and network first
#                                                  # (tools/check_dist.py instead of training)
#
# Any #PBS line above can be overridden on the qsub command line (-l select=64, -q prod,
# -l walltime=06:00:00, -A PROJECT, -l filesystems=home:flare).
#
# Settings (environment):
#   NGPUS_PER_NODE         ranks per node (default 12: the tiles of an Aurora node, one each)
#   NNODES                 --dry-run on a login node: the nodes the job will have (its select=N;
#                          default 1); in a job it may be set only to the job's node count
#   DEVICE                 training.device for the ranks (default xpu; cpu runs the same launch
#                          on a machine without Intel GPUs, over gloo)
#   FRAMEWORKS_MODULE      the module that brings PyTorch for XPU, oneCCL and DeepSpeed (default
#                          frameworks; ALCF's page suggests frameworks_optimized beyond 16 nodes);
#                          loaded when no Python environment is active (VIRTUAL_ENV, CONDA_PREFIX)
#                          and the module command exists; none: never
#   PYTHON                 the interpreter to run (default: python from the active environment)
#   MPI_FLAVOR             pals (Aurora's Cray mpiexec) or hydra (MPICH); detected by default
#   OVERRIDES              overrides when none are given as arguments, separated by spaces and
#                          quoted as in a shell; qsub -v splits its list at commas, so a value
#                          with a comma goes in OVERRIDES_FILE instead
#   OVERRIDES_FILE         a file of overrides, one per line, taken as written (# comments skipped)
#   WALLTIME               HH:MM:SS the job has left; default: read from qstat
#   CHECKPOINT_MARGIN_MIN  minutes before walltime at which the run saves and exits (default 10)
#   HANG_GRACE_MIN         a run still going this long after that signal is stuck: SIGUSR2 (each
#                          rank writes where it is, tools/hang_report.py), then SIGTERM (default:
#                          half the margin; must be under it)
#   CHAIN                  N: queue the next job as this one starts (qsub -W depend=afterany, the
#                          same resources and settings, CHAIN=N-1); a finished or failed run
#                          cancels it (docs/launch.md)
#   CPU_BIND               mpiexec --cpu-bind value under Cray PALS (default: ALCF's list for 12
#                          ranks per node, 8 cores each, cores 0 and 52 left to the system)
#   CCL_WORKER_AFFINITY    the core of each rank's oneCCL worker thread (default: one inside each
#                          rank's own cores); the other CCL_*/FI_* variables below are kept when set
set -euo pipefail
# PBS runs a copy of this script from its spool: the repository is where qsub was run.
cd "${PBS_O_WORKDIR:-$(dirname "$0")/..}"
[[ -f pretrain.py && -f launch/pbs_common.sh ]] || { echo "error: $PWD is not the repository's root (no pretrain.py there): run qsub from the repository's root (PBS_O_WORKDIR=${PBS_O_WORKDIR:-unset})" >&2; exit 2; }
SCRIPT=aurora.sh
# What a chained successor job keeps (CHAIN=N): this script's settings, as this job had them.
CHAIN_SETTINGS="NGPUS_PER_NODE DEVICE FRAMEWORKS_MODULE PYTHON MPI_FLAVOR CHECKPOINT_MARGIN_MIN HANG_GRACE_MIN CPU_BIND CCL_WORKER_AFFINITY"
source launch/pbs_common.sh

# The frameworks module (PyTorch for XPU, oneCCL, DeepSpeed), before Python is first used.
MODULE="${FRAMEWORKS_MODULE:-frameworks}"
if [[ "$MODULE" == none ]]; then
    MODULE_INFO="Python: ${PYTHON:-python} (FRAMEWORKS_MODULE=none)"
elif [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]]; then
    MODULE_INFO="Python: the active environment ${VIRTUAL_ENV:-$CONDA_PREFIX} (no module loaded)"
elif declare -F module > /dev/null || command -v module > /dev/null; then
    module load "$MODULE" || { echo "error: module load $MODULE failed: name a frameworks module that exists (module avail frameworks) in FRAMEWORKS_MODULE" >&2; exit 2; }
    MODULE_INFO="Python: module $MODULE"
else
    MODULE_INFO="Python: ${PYTHON:-python} (no module command here)"
fi

pbs_parse "$@"
pbs_count_nodes 12
DEVICE="${DEVICE:-xpu}"
[[ "$DEVICE" == xpu || "$DEVICE" == cpu ]] || { echo "error: DEVICE=$DEVICE: xpu (Aurora's tiles) or cpu" >&2; exit 2; }
if [[ "$PROGRAM" == pretrain.py && " ${OVERRIDES_ARR[*]:-} " != *" training.device="* ]]; then
    OVERRIDES_ARR+=("training.device=$DEVICE")
fi
export DS_ACCELERATOR="$DEVICE"
# The first node's name on the high-speed network (ALCF's examples rendezvous there), where the
# node file names Aurora's hosts.
if [[ "$MASTER_ADDR" == *.aurora.alcf.anl.gov ]]; then
    MASTER_ADDR="${MASTER_ADDR%%.*}.hsn.cm.aurora.alcf.anl.gov"
fi
pbs_walltime
pbs_check_recipe

# Each tile one device: the frameworks module sets this; without it only 6 devices are seen and
# local ranks 6-11 fail (ALCF's ezpz and PyTorch pages). Rank r takes xpu:LOCAL_RANK.
export ZE_FLAT_DEVICE_HIERARCHY="${ZE_FLAT_DEVICE_HIERARCHY:-FLAT}"
# oneCCL over Slingshot, as ALCF's oneCCL page (docs.alcf.anl.gov/aurora/data-science/frameworks/oneCCL/)
# and argonne-lcf/Megatron-DeepSpeed (ALCF/helpers.sh, set_ccl_vars_on_aurora) set it: key-value
# exchange and transport over MPI (PMIx under PALS), the CXI libfabric provider, larger
# completion queues, synchronous collectives (the same page and ALCF's ezpz page: a hang at scale
# otherwise). A value already in the environment is kept.
setdefault() { [[ -n "${!1+set}" ]] || export "$1=$2"; }
setdefault CCL_PROCESS_LAUNCHER pmix
setdefault CCL_ATL_TRANSPORT mpi
setdefault CCL_KVS_MODE mpi
setdefault CCL_KVS_USE_MPI_RANKS 1
setdefault CCL_KVS_CONNECTION_TIMEOUT 600
setdefault CCL_CONFIGURATION cpu_gpu_dpcpp
setdefault CCL_BCAST double_tree
setdefault CCL_ALLREDUCE_SCALEOUT "direct:0-1048576;rabenseifner:1048577-max"
setdefault CCL_ZE_CACHE_OPEN_IPC_HANDLES_THRESHOLD 1024
setdefault CCL_ATL_SYNC_COLL 1
setdefault CCL_OP_SYNC 1
setdefault PALS_PMI pmix
setdefault FI_PROVIDER cxi
setdefault MPI_PROVIDER "$FI_PROVIDER"
setdefault FI_CXI_DEFAULT_CQ_SIZE 1048576
setdefault FI_CXI_RX_MATCH_MODE hybrid
setdefault FI_CXI_OFLOW_BUF_SIZE 8388608
setdefault FI_CXI_CQ_FILL_PERCENT 30
setdefault FI_MR_CACHE_MONITOR disabled
CCL_INFO="oneCCL: KVS and transport over MPI ($CCL_PROCESS_LAUNCHER), libfabric $FI_PROVIDER, ZE_FLAT_DEVICE_HIERARCHY=$ZE_FLAT_DEVICE_HIERARCHY"

# ALCF's list for 12 ranks per node (docs.alcf.anl.gov/aurora/running-jobs-aurora/, "1 node, 12
# ranks/node"): 8 physical cores each, six ranks per socket, cores 0 and 52 (the first of each
# socket) reserved for the system since 2025-03-31. Fewer ranks take the first entries; each
# rank's oneCCL worker runs on a core of its own block (argonne-lcf's pairing).
BLOCKS=(1-8 9-16 17-24 25-32 33-40 41-48 53-60 61-68 69-76 77-84 85-92 93-100)
WORKERS=(5 13 21 29 37 45 57 65 73 81 89 97)
pbs_mpi_flavor
if [[ "$FLAVOR" == hydra ]]; then  # MPICH's launcher (not Aurora): -genvall exports the env
    PLACE_INFO="placement: none (Hydra; the core lists are for Aurora's Cray PALS)"
else
    if [[ -z "${CPU_BIND:-}" ]]; then
        ((PPN <= ${#BLOCKS[@]})) || { echo "error: NGPUS_PER_NODE=$PPN: an Aurora node has 12 tiles; give CPU_BIND for more ranks per node" >&2; exit 2; }
        CPU_BIND="list:$(IFS=:; echo "${BLOCKS[*]:0:$PPN}")"
        PLACE_INFO="placement: --cpu-bind $CPU_BIND (ALCF's list: 8 cores per rank, cores 0 and 52 left to the system)"
        setdefault CCL_WORKER_AFFINITY "$(IFS=,; echo "${WORKERS[*]:0:$PPN}")"
    else
        PLACE_INFO="placement: --cpu-bind $CPU_BIND (CPU_BIND)"
    fi
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+--hostfile "$NODEFILE"} --cpu-bind "$CPU_BIND" --envall)
fi
DEVICE_INFO="device: $DEVICE (DS_ACCELERATOR=$DS_ACCELERATOR), local rank r on ${DEVICE/xpu/tile} r"
CMD=("${MPI[@]}" "${PYTHON:-python}" "$PROGRAM" ${RECIPE:+"$RECIPE"} "${OVERRIDES_ARR[@]}")
pbs_launch "$MODULE_INFO" "$CCL_INFO" "$PLACE_INFO" "$DEVICE_INFO"
