# Sourced by train.sbatch and train-horovodrun.sbatch (bash): run the launcher, hand Slurm's stop
# signal to it, and, after a checkpointed stop, requeue the job when that is what the stop asked for.
#
#   run_and_requeue SIGNAL COMMAND...
#
# COMMAND (srun, or hvdtrain launch) runs in the background while this shell waits: a shell that
# waits on a foreground command cannot act on a signal until the command ends. SIGTERM or SIGUSR1
# to this shell (`#SBATCH --signal=B:USR1@120` ahead of the time limit, `scancel`, `scancel --batch
# --signal=...`, a preemption, `scontrol requeue`) is handed to COMMAND as SIGNAL, and its name
# is written into the stop file $HVDTRAIN_STOP_FILE (in a folder only this user can write to),
# which the ranks also read: a rank still starting, or one its launcher cannot reach yet, stops at
# its first step all the same. The ranks stop at the next step, checkpoint, and exit 75. A second
# signal while the first is handled is absorbed. A signal that came before COMMAND started (the
# script sets `stop_signal` from its first line, see the scripts) ends the job with 75 at once:
# nothing has run, nothing is lost.
#
# Then, by COMMAND's exit code:
#   75   stopped after a checkpoint. What happens next follows what stopped it, as Slurm tells
#        (`scontrol show job`: Restarts, JobState, EndTime against StartTime + TimeLimit,
#        PreemptTime) and the signal this shell got:
#        - Slurm requeued the job already (`scontrol requeue`, a preemption or a node failure
#          with requeue: Restarts went up): said, nothing more to do; it resumes from the checkpoint.
#        - the job is cancelled (`scancel JOB`: it ends, COMPLETING, before its time limit): not
#          requeued; the checkpoint is kept, and the line says the command that continues the run
#          in a new job.
#        - the time-limit signal (SIGUSR1 to this shell: `--signal=B:USR1@N`, or `scancel --batch
#          --signal=USR1` by hand), the time limit itself (it ends at its limit) or a preemption
#          Slurm has not requeued yet (PreemptTime set): `scontrol requeue` puts the job back in the
#          queue (#SBATCH --requeue), where it resumes from the checkpoint, at most
#          HVDTRAIN_MAX_REQUEUES times (default 20; SLURM_RESTART_COUNT counts them), then it ends 75.
#        - anything else (SIGTERM from `scancel --signal=TERM`, or a Slurm that does not answer):
#          a stop, not requeued; the line says how to continue.
#        A stop that is not requeued ends the job with 75 (Slurm: FAILED 75:0, or CANCELLED), on
#        purpose: the run is not finished, and a job ending 0 would read COMPLETED and release the
#        jobs that wait on it with --dependency=afterok.
#   else the job ends with that code: 0 finished, 2 bad configuration or data (or attempts that
#        stop before a step, twice: hvdtrain says how long start-up and a step take, and what --time
#        to ask for), 74 a disk too full for the checkpoint, 1 a crash. None of these is requeued: a
#        retry as it is would not help.
# Nothing is left behind: a COMMAND still running when this shell leaves (an error in the script)
# gets SIGKILL, with every process it started.
#
# The scripts set `job_script` (the script as submitted) and `job_args` (its arguments, quoted) for
# the line that says how to continue; hvdtrain's rank 0 writes the run folder into the stop folder
# (`run_dir`).

descendants() {
    local pid
    for pid in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$pid"
        echo "$pid"
    done
}

# The stop file's folder, private to this user (mktemp -d: mode 700), removed when the script ends.
# Called by the scripts before they start anything that waits on it (train-horovodrun's helper step).
prepare_stop_file() {
    [[ -z ${HVDTRAIN_STOP_DIR:-} ]] || return 0
    HVDTRAIN_STOP_DIR=$(mktemp -d "${TMPDIR:-/tmp}/hvdtrain-job-${SLURM_JOB_ID:-local}.XXXXXX")
    export HVDTRAIN_STOP_DIR HVDTRAIN_STOP_FILE=$HVDTRAIN_STOP_DIR/stop
    # shellcheck disable=SC2064  # the folder, fixed now
    trap "rm -rf '$HVDTRAIN_STOP_DIR'" EXIT
}

# dist.engine=torch: rank 0's host and a port of this job's own for torch.distributed's rendezvous,
# exported for the ranks (a port shared by two jobs on a node stops the second). The host: the
# allocation's first node, where this shell runs and where srun and horovodrun place rank 0. The
# port: derived from the job id (15000 + id % 15000), else the first of the next 99 that this node
# lets bind. A MASTER_ADDR or MASTER_PORT of the user's is kept. And the job's secret, which the
# torch engine's ranks prove to one another (docs/security.md): made here for each attempt, in the
# environment srun hands to the ranks, never on a command line; a user's own is kept.
export_master() {
    local first port=""
    if [[ -z ${HVDTRAIN_JOB_SECRET:-} ]]; then
        HVDTRAIN_JOB_SECRET=$("$PYTHON" -I -S -c 'import secrets; print(secrets.token_hex(32))') || {
            echo "hvdtrain: job ${SLURM_JOB_ID:-?}: could not make a job secret for dist.engine=torch:" \
                "export HVDTRAIN_JOB_SECRET=\$(openssl rand -hex 32) before sbatch" >&2; }
        export HVDTRAIN_JOB_SECRET
    fi
    if [[ -z ${MASTER_ADDR:-} ]]; then
        first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | sed -n 1p) || first=""  # sed reads all: no SIGPIPE
        export MASTER_ADDR=${first:-$(hostname -s)}
    fi
    [[ -z ${MASTER_PORT:-} ]] || return 0
    if [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then
        port=$("$PYTHON" -I -S -c '
import socket, sys
for i in range(100):
    port = 15000 + (int(sys.argv[1]) + i) % 15000
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            continue
    print(port)
    break' "$SLURM_JOB_ID" 2>/dev/null) || port=""
    fi
    if [[ -n $port ]]; then
        export MASTER_PORT=$port
    else
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: no free port found for MASTER_PORT (dist.engine=torch needs one):" \
            "export MASTER_PORT=<a free port> before sbatch" >&2
    fi
}

# What Slurm says of the job now (`scontrol show job`): sets shown_restarts (how many times Slurm
# has requeued it: one more than the attempt's own SLURM_RESTART_COUNT once it is requeued, by this
# script or by whoever stopped it, while this attempt is still ending), shown_preempt (PreemptTime:
# set once Slurm has chosen the job for preemption) and shown_state (JobState: RUNNING, ...). A job
# that is ending shows COMPLETING whatever ends it: a cancelled one has its EndTime set to the
# cancel, before its time limit is up (StartTime + TimeLimit); one at its limit, that limit. Such a
# job's shown_state is CANCELLED or TIMEOUT here. All empty when Slurm does not answer (a busy
# slurmctld, over about 10 s of tries): unknown is not "0". `answer_pause` (seconds between tries;
# 1, 2, 3 by default) is for the script's tests.
look_at_job() {
    local try shown="" start end limit
    shown_restarts="" shown_state="" shown_preempt=""
    for try in 1 2 3 4; do
        shown=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null) || shown=""
        shown_restarts=$(field Restarts <<<"$shown")
        [[ -n $shown_restarts || $try == 4 ]] && break
        sleep "${answer_pause:-$try}"
    done
    [[ -n $shown_restarts ]] || return 0
    shown_state=$(field JobState <<<"$shown")
    shown_preempt=$(field PreemptTime <<<"$shown")
    [[ $shown_preempt != None ]] || shown_preempt=""
    if [[ $shown_state == COMPLETING ]]; then
        end=$(field EndTime <<<"$shown")
        limit=$(field TimeLimit <<<"$shown")
        end=$(date -d "$end" +%s 2>/dev/null) || return 0
        shown_state=CANCELLED
        [[ $limit != UNLIMITED ]] || return 0
        start=$(date -d "$(field StartTime <<<"$shown")" +%s 2>/dev/null) || return 0
        limit=$(seconds "$limit") || return 0
        ((end < start + limit)) || shown_state=TIMEOUT
    fi
}

# The value of `NAME=value` in what scontrol shows (read from stdin).
field() {
    sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p" | head -1
}

# Slurm's [DAYS-]HH:MM:SS (or MM:SS) in seconds.
seconds() {
    local text=$1 days=0 total=0 part
    [[ $text =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$ ]] || return 1
    if [[ $text == *-* ]]; then
        days=${text%%-*}
        text=${text#*-}
    fi
    IFS=: read -ra parts <<<"$text"
    for part in "${parts[@]}"; do
        total=$((total * 60 + 10#$part))
    done
    echo $((days * 86400 + total))
}

# What asks for a requeue, as this shell and Slurm saw the stop (see above), or nothing (exit 1).
requeue_reason() {
    if [[ -n $shown_preempt || $shown_state == PREEMPTED ]]; then
        echo "a preemption"
    elif [[ $shown_state == CANCELLED ]]; then
        return 1
    elif [[ ${stopped_by:-} == USR1 ]]; then
        echo "the time-limit signal (SIGUSR1)"
    elif [[ $shown_state == TIMEOUT ]]; then
        echo "the time limit"
    else
        return 1
    fi
}

# The command that continues this run in a new job: the same script and arguments, the run folder
# and its last checkpoint (a new job continues another job's run only when asked to).
continue_hint() {
    local folder=""
    if [[ -n ${HVDTRAIN_STOP_DIR:-} && -f $HVDTRAIN_STOP_DIR/run_dir && ! -L $HVDTRAIN_STOP_DIR/run_dir ]]; then
        folder=$(head -c 4096 "$HVDTRAIN_STOP_DIR/run_dir")
    fi
    local quoted=${folder:+$(printf '%q' "$folder")}
    echo "to continue the run: sbatch [the same options] ${job_script:-SCRIPT}${job_args:-}" \
        "output.dir=${quoted:-RUN_FOLDER} checkpoint.resume=${quoted:-RUN_FOLDER}/checkpoints/last.pt"
}

# The closing line of an attempt that Slurm has requeued already (from outside, or between this
# script's two looks): requeuing it again fails, and "submit again" would start a second job on the
# same run folder.
say_requeued_already() {
    echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75): requeued already by Slurm" \
        "(restart $1); it resumes from the checkpoint" >&2
}

run_and_requeue() {
    local forward=$1
    shift
    prepare_stop_file
    local child code=0 filter="" stopping=${stop_signal:-}
    stopped_by=""
    if [[ -n $stopping ]]; then
        stopped_by=$stopping
        echo "$stopping" >"$HVDTRAIN_STOP_FILE"
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$stopping) received before the ranks started:" \
            "nothing to checkpoint, ending with 75" >&2
        code=75
    else
        start_command "$@"
        launched=$SECONDS
        # shellcheck disable=SC2064  # the child's pid and the signal, fixed now
        trap "on_stop TERM $forward $child" TERM
        # shellcheck disable=SC2064
        trap "on_stop USR1 $forward $child" USR1
        # shellcheck disable=SC2064
        trap "kill -KILL \$(descendants $child) $child 2>/dev/null || true; rm -rf '$HVDTRAIN_STOP_DIR'" EXIT
        [[ -z ${stop_signal:-} ]] || on_stop "$stop_signal" "$forward" "$child"  # between the checks
        while :; do
            interrupted=0
            wait "$child" && code=0 || code=$?
            ((interrupted)) || break  # a signal interrupts wait: wait again for the real exit code
        done
        # The filter's last lines before this script's own (it ends once COMMAND's stderr closes).
        [[ -z $filter ]] || wait "$filter" 2>/dev/null || true
    fi
    # The job is ending: a late signal changes nothing. Ignored, not trapped: the commands below
    # (scontrol, and the subshells they run in) inherit that, and survive the SIGTERM Slurm sends
    # every process of a job it requeues or cancels.
    trap '' TERM USR1
    local restarts=${SLURM_RESTART_COUNT:-0} most=${HVDTRAIN_MAX_REQUEUES:-20} said="" asked why
    if ((code == 75)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
        local stopped="hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75)"
        look_at_job
        if [[ -n $shown_restarts ]] && ((shown_restarts > restarts)); then
            say_requeued_already "$shown_restarts"
            code=0
        elif [[ $shown_state == CANCELLED && -z $shown_preempt ]]; then
            echo "hvdtrain: job $SLURM_JOB_ID cancelled (scancel) after a checkpoint: not requeued, the checkpoint" \
                "is kept; $(continue_hint)" >&2
        elif [[ -z $shown_restarts && ${stopped_by:-} != USR1 ]]; then
            echo "$stopped; Slurm did not answer what stopped it (a cancel, a preemption?): not requeued;" \
                "see \`scontrol show job $SLURM_JOB_ID\`; $(continue_hint)" >&2
        elif ! why=$(requeue_reason); then
            echo "$stopped by ${stopped_by:+SIG}${stopped_by:-a signal to its ranks}, which asks for no requeue" \
                "(the time-limit signal SIGUSR1, a preemption or \`scontrol requeue\` do): not requeued;" \
                "$(continue_hint)" >&2
        elif ((restarts >= most)); then
            echo "$stopped at $why and was requeued $restarts times already (HVDTRAIN_MAX_REQUEUES=$most):" \
                "not requeued again; $(continue_hint)" >&2
        else
            said=$(scontrol requeue "$SLURM_JOB_ID" 2>&1) && asked=1 || asked=0
            look_at_job
            if [[ -n $shown_restarts ]] && ((shown_restarts > restarts)); then  # what Slurm shows, not what scontrol returned
                if ((asked)); then
                    echo "$stopped at $why: requeued (restart $shown_restarts of at most $most); it resumes" \
                        "from the checkpoint" >&2
                else  # ours failed: someone requeued it first ("Job is pending execution")
                    say_requeued_already "$shown_restarts"
                fi
                code=0
            elif [[ -z $shown_restarts ]]; then
                echo "$stopped at $why; Slurm did not answer whether it is requeued (scontrol requeue:" \
                    "${said:-asked}): see Restarts= in \`scontrol show job $SLURM_JOB_ID\`; if it is not," \
                    "$(continue_hint)" >&2
            else
                echo "$stopped at $why and could not be requeued (${said:-Slurm shows no requeue}: a cancelled" \
                    "job, or #SBATCH --no-requeue); $(continue_hint)" >&2
            fi
        fi
    fi
    return "$code"
}

# COMMAND in the background (its PID: child). `quiet_stops=1 run_and_requeue ...` (srun): srun's
# own line on ranks that stopped after a checkpoint ("srun: error: node1: tasks 0-1: Exited with
# exit code 75", one per node) is left out of COMMAND's stderr, which this script's closing line
# says better; every other line passes, as it comes (grep --line-buffered), a rank's exit code
# other than 75 too. srun has no option for that line alone (-Q keeps errors, -QQ would hide all
# of them). The filter ignores the SIGTERM Slurm sends every process of a job it cancels or
# requeues from its first line on (srun would kill its ranks on a broken stderr), and ends when
# COMMAND's stderr closes (PID: filter, waited for; none where bash gives no process
# substitution's PID, before 4.4).
start_command() {
    local before=${!:-} errors
    filter=""
    if [[ -n ${quiet_stops:-} ]]; then
        exec {errors}> >(trap '' TERM USR1 INT
            LC_ALL=C exec grep -a --line-buffered -v -E '^srun: error: .*: tasks? [0-9,-]+: Exited with exit code 75$' >&2)
        [[ ${!:-} == "$before" ]] || filter=$!
        "$@" 2>&"$errors" &
        child=$!
        exec {errors}>&-
    else
        "$@" &
        child=$!
    fi
}

# A stop signal while COMMAND runs: said once, written to the stop file, handed to COMMAND; a repeat
# (the helper step passing on the same stop, scontrol requeue's second signal) is absorbed.
# `forward_after=SECONDS run_and_requeue ...` (srun): COMMAND gets the signal only once it has run
# that long, or once hvdtrain's rank 0 has set up its run folder (it writes `run_dir` into the stop
# folder after every rank has joined the job, each with its handler set). srun hands the signal to
# every rank at once, and a rank still starting (on a slow file system, seconds of Python's own
# start-up before hvdtrain catches it) ends on SIGUSR1; until then the ranks read the stop file,
# and stop at their first step all the same. What the line says follows which of the two it was.
on_stop() {
    local got=$1 forward=$2 child=$3
    interrupted=1
    if [[ -n ${stopping_since:-} ]]; then
        return 0
    fi
    stopping_since=$SECONDS
    stopped_by=$got
    echo "$got" >"$HVDTRAIN_STOP_FILE"
    if ((SECONDS - ${launched:-0} >= ${forward_after:-0})) || [[ -f $HVDTRAIN_STOP_DIR/run_dir ]]; then
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$got) received, passed to the ranks as SIG$forward" >&2
        kill "-$forward" "$child" 2>/dev/null || true
    else
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$got) received while the ranks start (no run" \
            "folder yet, $((SECONDS - ${launched:-0})) s after srun): they read it from the stop file" >&2
    fi
}
