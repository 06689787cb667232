# The parts of a PBS job script that do not depend on the machine: sourced by launch/polaris.sh
# and launch/aurora.sh (from the repository's root, where PBS_O_WORKDIR is) after they set
# SCRIPT (their name) and, for chained jobs, CHAIN_SETTINGS (the settings a successor keeps).
#
# In order: pbs_parse "$@"; pbs_count_nodes DEFAULT_RANKS_PER_NODE; pbs_walltime;
# pbs_check_recipe; (the machine's environment, placement and MPI command: the script's own);
# pbs_launch INFO_LINE... (prints, then ends a --dry-run, else chains and runs the command in CMD).

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the script's header, as text (a sourced
    sed -n '/^# Train on/,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0  # file sees its "$@")
fi
# A chained successor job starts with its predecessor's settings (written by pbs_chain_start).
if [[ -n "${CHAIN_ENV:-}" ]]; then
    [[ -f "$CHAIN_ENV" ]] || { echo "error: CHAIN_ENV=$CHAIN_ENV does not exist: the chain's settings are lost; submit the job again with its settings" >&2; exit 2; }
    source "$CHAIN_ENV"
fi
# What a successor gets: the script's settings and the communication libraries' own (NCCL_*,
# FI_*, CCL_*), as this job was given them, before any default is filled or module loaded. They
# travel in a file: qsub -v splits its list at commas (CUDA_VISIBLE_DEVICES=0,1,2,3).
CHAIN_GIVEN=$(for _name in ${CHAIN_SETTINGS:-} $(compgen -e | grep -E '^(NCCL|FI|CCL)_' || true); do
    if [[ -n "${!_name+set}" ]]; then printf 'export %s=%q\n' "$_name" "${!_name}"; fi; done | sort -u)
ENV_AT_START=$(env | sort)  # what the script adds or changes is printed before the launch
# The walltime left is read from PBS at the start: exit_duration_mins counts from this moment, so
# that the recipe check, imports and model build before training are counted too.
export LAUNCH_START_EPOCH
LAUNCH_START_EPOCH=$(date +%s)

# ---------------------------------------------------------------- arguments and overrides
pbs_parse() {
    DRY_RUN=0
    local args=() arg
    for arg in "$@"; do  # --dry-run anywhere (after the recipe too): never a real launch by mistake
        if [[ "$arg" == "--dry-run" ]]; then DRY_RUN=1; else args+=("$arg"); fi
    done
    set -- ${args[@]+"${args[@]}"}
    RECIPE="${RECIPE:-}"
    # The first argument is the recipe unless it is an override (k=v) or an option (CHECK=1's).
    if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then RECIPE="$1"; shift; fi
    PROGRAM=pretrain.py
    if [[ "${CHECK:-0}" == 1 ]]; then
        PROGRAM=tools/check_dist.py  # the recipe is optional: its layout's groups are checked
    else
        [[ -n "$RECIPE" ]] || { echo "usage: launch/$SCRIPT [--dry-run] RECIPE [overrides]   (--help: the settings)" >&2; exit 2; }
    fi
    OVERRIDES_ARR=("$@")
    if [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${CHAIN_OVERRIDES+set}" ]]; then  # a chained job's (CHAIN_ENV)
        OVERRIDES_ARR=(${CHAIN_OVERRIDES[@]+"${CHAIN_OVERRIDES[@]}"})
    elif [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${OVERRIDES_FILE:-}" ]]; then
        [[ -f "$OVERRIDES_FILE" ]] || { echo "error: OVERRIDES_FILE=$OVERRIDES_FILE does not exist" >&2; exit 2; }
        local line
        while IFS= read -r line || [[ -n "$line" ]]; do
            line="${line#"${line%%[![:space:]]*}"}"; line="${line%"${line##*[![:space:]]}"}"
            [[ -z "$line" || "$line" == \#* ]] || OVERRIDES_ARR+=("$line")
        done < "$OVERRIDES_FILE"
    elif [[ ${#OVERRIDES_ARR[@]} -eq 0 && -n "${OVERRIDES:-}" ]]; then
        # Shell quoting rules without a shell's expansions (no eval): a quoted value keeps its
        # spaces. A process substitution's failure does not stop the script by itself: `wait $!`
        # collects its status, so an OVERRIDES that cannot be split stops the job instead of
        # training the recipe without the overrides.
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
    GIVEN_OVERRIDES=(${OVERRIDES_ARR[@]+"${OVERRIDES_ARR[@]}"})  # what a chained successor gets
    [[ "${CHAIN:-0}" =~ ^[0-9]+$ ]] || { echo "error: CHAIN=$CHAIN: give the number of jobs to queue after this one (0 or more)" >&2; exit 2; }
}

# ---------------------------------------------------------------- nodes and ranks
pbs_count_nodes() {  # $1: ranks per node by default; sets NODEFILE NNODES PPN NRANKS MASTER_ADDR
    NODEFILE="${PBS_NODEFILE:-}"
    if [[ -n "$NODEFILE" && ! -f "$NODEFILE" ]]; then echo "error: PBS_NODEFILE=$NODEFILE does not exist" >&2; exit 2; fi
    # A dry run on a login node (no PBS_NODEFILE) checks the layout for NNODES nodes, the job's
    # select=N; a job counts its nodes in PBS_NODEFILE (an NNODES a job script exported must agree).
    local wanted="${NNODES:-}"
    [[ -z "$wanted" || "$wanted" =~ ^[1-9][0-9]*$ ]] || { echo "error: NNODES=$wanted: give the nodes the job will have, a positive integer" >&2; exit 2; }
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
    if [[ -n "$wanted" && -z "$NODEFILE" && $DRY_RUN -eq 1 ]]; then
        NNODES="$wanted"
    elif [[ -n "$wanted" && "$wanted" != "$NNODES" ]]; then
        echo "error: NNODES=$wanted, but this job has $NNODES node(s) (${NODEFILE:+the lines of PBS_NODEFILE=$NODEFILE}${NODEFILE:-no PBS_NODEFILE: this node}); NNODES is for a --dry-run on a login node: unset it" >&2
        exit 2
    fi
    PPN="${NGPUS_PER_NODE:-$1}"
    [[ "$PPN" =~ ^[1-9][0-9]*$ ]] || { echo "error: NGPUS_PER_NODE=$PPN: give the ranks per node, a positive integer" >&2; exit 2; }
    NRANKS=$((NNODES * PPN))
    MASTER_ADDR=$([[ -n "$NODEFILE" ]] && awk 'NF {print $1; exit}' "$NODEFILE" || hostname)
    export MASTER_ADDR MASTER_PORT="${MASTER_PORT:-29500}"
}

# ---------------------------------------------------------------- walltime
# Stop in time to checkpoint: PBS Pro cannot signal a job before its walltime, so this script
# does. It sets training.exit_duration_mins (the trainer saves and exits 0 that long after its
# start; a recipe without checkpoint.dir has nothing to save and exits 1 there) and, as a second
# line, sends SIGUSR1 to mpiexec (which forwards it to the ranks; the
# trainer saves and exits on it, checkpoint.save_on_signal) CHECKPOINT_MARGIN_MIN before walltime.
# A run still there HANG_GRACE_MIN later is stuck: SIGUSR2 first (every rank writes where it is,
# distributed/hang.py), then SIGTERM.
_seconds() {  # HH:MM:SS -> seconds (empty when it is not that)
    [[ "$1" =~ ^([0-9]+):([0-9]+):([0-9]+)$ ]] || return 0
    echo $((10#${BASH_REMATCH[1]} * 3600 + 10#${BASH_REMATCH[2]} * 60 + 10#${BASH_REMATCH[3]}))
}

pbs_walltime() {  # sets SIGNAL_AFTER_S (empty: unknown) and HANG_GRACE_S
    local margin_min="${CHECKPOINT_MARGIN_MIN:-10}" left_s limit_s used_s qstat_out
    [[ "$margin_min" =~ ^[0-9]+$ ]] || { echo "error: CHECKPOINT_MARGIN_MIN=$margin_min: give whole minutes" >&2; exit 2; }
    local grace="${HANG_GRACE_MIN:-$(awk -v m="$margin_min" 'BEGIN {print m / 2}')}"  # default: half the margin
    [[ "$grace" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "error: HANG_GRACE_MIN=$grace: give minutes (a number)" >&2; exit 2; }
    if [[ -n "${HANG_GRACE_MIN:-}" ]] && awk -v g="$grace" -v m="$margin_min" 'BEGIN {exit !(g >= m)}'; then
        echo "error: HANG_GRACE_MIN=$grace must be under CHECKPOINT_MARGIN_MIN=$margin_min: the hang report would come after the walltime" >&2
        exit 2
    fi
    HANG_GRACE_S=$(awk -v m="$grace" 'BEGIN {printf "%d", m * 60 + 0.5}')
    left_s=$(_seconds "${WALLTIME:-}")
    if [[ -z "${WALLTIME:-}" && -n "${PBS_JOBID:-}" ]] && command -v qstat > /dev/null; then
        qstat_out=$(qstat -f "$PBS_JOBID" 2> /dev/null || true)
        limit_s=$(_seconds "$(awk '/Resource_List.walltime/ {print $3}' <<< "$qstat_out")")
        used_s=$(_seconds "$(awk '/resources_used.walltime/ {print $3}' <<< "$qstat_out")")
        [[ -n "$limit_s" ]] && left_s=$((limit_s - ${used_s:-0}))
    fi
    SIGNAL_AFTER_S=""
    if [[ -n "$left_s" ]]; then
        SIGNAL_AFTER_S=$((left_s - margin_min * 60))
        if ((SIGNAL_AFTER_S > 0)) && [[ " ${OVERRIDES_ARR[*]:-} " != *" training.exit_duration_mins="* ]]; then
            # Whole minutes, or hundredths under one (a short test job: 0 would be no time at all).
            OVERRIDES_ARR+=("training.exit_duration_mins=$(awk -v s="$SIGNAL_AFTER_S" \
                'BEGIN {m = int(s / 60); print (m >= 1 ? m : int(s / 0.6) / 100)}')")
        fi
    fi
}

# ---------------------------------------------------------------- the recipe, once
# The recipe and overrides are checked here, once, before mpiexec starts a rank: a typo found
# by every rank after the job has waited in the queue would cost the allocation (and the
# launch a traceback per rank). `--dry-run` before qsub runs the same check without a job.
pbs_check_recipe() {  # sets RUN_DIR (the run's logging.dir) for a training run
    RUN_DIR=""
    [[ "$PROGRAM" == pretrain.py ]] || return 0
    local resolved ck_dir
    resolved=$("${PYTHON:-python}" pretrain.py "$RECIPE" "${OVERRIDES_ARR[@]}" --print-config \
        --world-size "$NRANKS" --gpus-per-node "$PPN") || exit 2
    { IFS= read -r RUN_DIR; IFS= read -r ck_dir; } < <("${PYTHON:-python}" -c '
import sys
from omegaconf import OmegaConf
cfg = OmegaConf.create(sys.stdin.read())
print(cfg.logging.dir); print(cfg.checkpoint.dir)' <<< "$resolved")
    if [[ "${CHAIN:-0}" != 0 && ( -z "$ck_dir" || "$ck_dir" == None ) ]]; then
        echo "error: CHAIN=$CHAIN with checkpoint.dir=null: every job would start the run again; give checkpoint.dir" >&2
        exit 2
    fi
}

# ---------------------------------------------------------------- mpiexec
pbs_mpi_flavor() {  # sets FLAVOR (pals: Cray's mpiexec; hydra: MPICH's) and MPI for Hydra
    FLAVOR="${MPI_FLAVOR:-}"
    if [[ -z "$FLAVOR" ]]; then
        FLAVOR=pals
        # Read the whole banner before matching: under pipefail, `mpiexec --version | grep -q`
        # fails whenever grep exits first and mpiexec dies of SIGPIPE.
        local banner
        banner=$(command -v mpiexec > /dev/null && mpiexec --version 2>&1 || true)
        if [[ "${banner,,}" == *hydra* ]]; then FLAVOR=hydra; fi
    fi
    MPI=(mpiexec -n "$NRANKS" -ppn "$PPN" ${NODEFILE:+-hostfile "$NODEFILE"} -genvall)  # Hydra's spelling
}

# ---------------------------------------------------------------- chained jobs
# CHAIN=N: this job submits its successor as it starts (qsub -W depend=afterany:THIS_JOB, the
# same script, resources and settings, CHAIN=N-1), so the next allocation is queued while this
# one trains. At the end: a run that is finished (logging.dir/finished.json, written by the
# trainer) or that failed (any exit status but 0, the status of a run that saved and stopped
# for walltime) cancels the successor; the chain ends, and its files (.chain/CHAIN_OF.JOB.env:
# the recipe, overrides and settings) go with it. A successor that finds the run
# finished exits at once.
_qstat_field() { awk -v key="$1" '$1 == key {sub(/^[^=]*= /, ""); print; exit}' <<< "$2"; }

pbs_chain_start() {  # sets NEXT_JOB (empty: none submitted)
    NEXT_JOB=""
    local chain="${CHAIN:-0}"
    if [[ -n "${CHAIN_OF:-}" && -n "$RUN_DIR" && -f "$RUN_DIR/finished.json" ]]; then
        echo "chain: the run in $RUN_DIR is finished ($RUN_DIR/finished.json): nothing to do"
        _chain_files_removed
        exit 0
    fi
    ((chain > 0)) || return 0
    [[ -n "${PBS_JOBID:-}" ]] || { echo "chain: CHAIN=$chain outside a PBS job (no PBS_JOBID): nothing is submitted" >&2; return 0; }
    local info resources=() vars
    info=$(qstat -f "$PBS_JOBID" 2> /dev/null || true)
    local select_ walltime queue account filesystems place
    select_=$(_qstat_field Resource_List.select "$info"); walltime=$(_qstat_field Resource_List.walltime "$info")
    filesystems=$(_qstat_field Resource_List.filesystems "$info"); place=$(_qstat_field Resource_List.place "$info")
    # The queue the job was submitted to (a routing queue such as prod), not the one it runs in.
    queue="${PBS_O_QUEUE:-$(_qstat_field queue "$info")}"; account=$(_qstat_field Account_Name "$info")
    [[ -n "$account" ]] && resources+=(-A "$account")
    [[ -n "$queue" ]] && resources+=(-q "$queue")
    local item
    for item in "select=$select_" "walltime=$walltime" "filesystems=$filesystems" "place=$place"; do
        [[ "$item" == *= ]] || resources+=(-l "$item")
    done
    # The recipe, overrides and settings travel in a file (qsub -v splits its list at commas),
    # shell-quoted: an override with a newline or edge spaces arrives byte for byte.
    mkdir -p "$PWD/.chain"
    local env_file="$PWD/.chain/${CHAIN_OF:-$PBS_JOBID}.${PBS_JOBID}.env"
    { [[ -z "$CHAIN_GIVEN" ]] || printf '%s\n' "$CHAIN_GIVEN"
      printf 'export RECIPE=%q\nCHAIN_OVERRIDES=(' "$RECIPE"
      [[ ${#GIVEN_OVERRIDES[@]} -eq 0 ]] || printf ' %q' "${GIVEN_OVERRIDES[@]}"
      printf ' )\n'; } > "$env_file"
    vars="CHAIN_ENV=$env_file,CHAIN=$((chain - 1)),CHAIN_OF=${CHAIN_OF:-$PBS_JOBID}"
    NEXT_JOB=$(qsub "${resources[@]}" -W "depend=afterany:$PBS_JOBID" -v "$vars" "$PWD/launch/$SCRIPT") || {
        echo "error: CHAIN=$chain: qsub of the next job failed; this job trains without a successor" >&2; NEXT_JOB=""; return 0; }
    echo "chain: submitted $NEXT_JOB (after this job, CHAIN=$((chain - 1)))"
}

_chain_files_removed() {  # the chain ends: its files are read by no further job
    [[ -n "${CHAIN_OF:-}${NEXT_JOB:-}" && -n "${PBS_JOBID:-}" ]] || return 0
    rm -f "$PWD/.chain/${CHAIN_OF:-$PBS_JOBID}".*.env
}

pbs_chain_end() {  # $1: the run's exit status
    if [[ -z "$NEXT_JOB" ]]; then  # the chain's last job (or its successor could not be queued)
        _chain_files_removed
        return 0
    fi
    local why=""
    if [[ -n "$RUN_DIR" && -f "$RUN_DIR/finished.json" ]]; then
        why="the run is finished ($RUN_DIR/finished.json)"
    elif [[ -n "${TERMINATED:-}" ]]; then  # qdel: the run saves and exits 0, but was told to stop
        why="the job was sent SIGTERM (qdel)"
    elif [[ "$1" != 0 ]]; then
        why="the run failed (exit status $1; 0 is a run that saved and stopped for walltime)"
    fi
    if [[ -n "$why" ]]; then
        qdel "$NEXT_JOB" || echo "chain: qdel $NEXT_JOB failed: cancel it by hand" >&2
        echo "chain: $why: cancelled $NEXT_JOB; the chain ends"
        _chain_files_removed
    fi
}

# ---------------------------------------------------------------- print, then run
_nap() {  # sleep that the watcher's SIGTERM ends at once (a bare sleep would outlive it)
    sleep "$1" & NAP=$!
    wait "$NAP"
}

_walltime_watcher() {  # $1: mpiexec's pid; $2: seconds until SIGUSR1
    trap 'kill "$NAP" 2> /dev/null; exit 0' TERM
    _nap "$2"
    kill -USR1 "$1" 2> /dev/null || return 0
    _nap "$HANG_GRACE_S"
    kill -0 "$1" 2> /dev/null || return 0
    echo "still running ${HANG_GRACE_S} s after SIGUSR1: stuck; SIGUSR2 (each rank writes where it is, tools/hang_report.py), then SIGTERM in 60 s" >&2
    kill -USR2 "$1" 2> /dev/null || return 0
    _nap 60
    kill -TERM "$1" 2> /dev/null || true
}

pbs_launch() {  # $@: lines that describe the launch; runs CMD
    local info="nodes: $NNODES × $PPN ranks, master $MASTER_ADDR:$MASTER_PORT${FLAVOR:+, mpiexec flavor $FLAVOR}"
    [[ -n "$SIGNAL_AFTER_S" ]] && info+=", SIGUSR1 to mpiexec after ${SIGNAL_AFTER_S} s (SIGUSR2, then SIGTERM, ${HANG_GRACE_S} s later if still running)"
    [[ "${CHAIN:-0}" != 0 ]] && info+=", CHAIN=${CHAIN}"
    printf '%s\n' "$@" "$info"
    echo "environment set for the ranks:"
    comm -13 <(echo "$ENV_AT_START") <(env | sort) | grep -v -E '^(OLDPWD|PWD|SHLVL|_)=' | sed 's/^/  /'
    local quoted
    quoted=$(printf '%q ' "${CMD[@]}")  # as a shell would need it: each argument's bounds visible
    echo "${quoted% }"
    [[ $DRY_RUN -eq 1 ]] && exit 0

    pbs_chain_start
    "${CMD[@]}" &
    MPI_PID=$!
    # Signals sent to this script (qdel's SIGTERM, a manual SIGUSR1 or SIGUSR2) go to the ranks
    # through mpiexec.
    trap 'TERMINATED=1; kill -TERM "$MPI_PID" 2> /dev/null' TERM
    trap 'kill -USR1 "$MPI_PID" 2> /dev/null' USR1
    trap 'kill -USR2 "$MPI_PID" 2> /dev/null' USR2
    local watcher=""
    if [[ -n "$SIGNAL_AFTER_S" ]] && ((SIGNAL_AFTER_S > 0)); then
        # Counted, like the walltime, from this script's start (SECONDS), not from mpiexec's.
        _walltime_watcher "$MPI_PID" "$((SIGNAL_AFTER_S > SECONDS ? SIGNAL_AFTER_S - SECONDS : 0))" &
        watcher=$!
    fi
    local status=0
    while kill -0 "$MPI_PID" 2> /dev/null; do  # a trapped signal interrupts wait: wait again
        wait "$MPI_PID" && status=0 || status=$?
    done
    [[ -n "$watcher" ]] && kill "$watcher" 2> /dev/null || true
    pbs_chain_end "$status"
    exit "$status"
}
