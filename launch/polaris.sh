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
#   HANG_GRACE_MIN         a run still going this long after that signal is stuck: SIGUSR2 (each
#                          rank writes where it is, tools/hang_report.py), then SIGTERM (default:
#                          half the margin; must be under it)
#   CHAIN                  N: queue the next job as this one starts (qsub -W depend=afterany, the
#                          same resources and settings, CHAIN=N-1), for runs longer than a
#                          job's walltime; a finished or failed run cancels it (docs/launch.md)
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
# PBS runs a copy of this script from its spool: the repository is where qsub was run.
cd "${PBS_O_WORKDIR:-$(dirname "$0")/..}"
[[ -f pretrain.py && -f launch/pbs_common.sh ]] || { echo "error: $PWD is not the repository's root (no pretrain.py there): run qsub from the repository's root (PBS_O_WORKDIR=${PBS_O_WORKDIR:-unset})" >&2; exit 2; }
SCRIPT=polaris.sh
# What a chained successor job keeps (CHAIN=N): this script's settings, as this job had them.
CHAIN_SETTINGS="NGPUS_PER_NODE PYTHON MPI_FLAVOR CHECKPOINT_MARGIN_MIN HANG_GRACE_MIN NCCL_OFI_PLUGIN_DIR CPU_BIND CUDA_VISIBLE_DEVICES PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF"
source launch/pbs_common.sh
pbs_parse "$@"
pbs_count_nodes 4

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

pbs_walltime
pbs_check_recipe

pbs_mpi_flavor
if [[ "$FLAVOR" == hydra ]]; then  # MPICH's launcher (not Polaris): -genvall exports the env
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
pbs_launch "$NCCL_INFO" "$PLACE_INFO" "$GPU_INFO" "$ALLOC_INFO"
