# Sourced by train.sbatch and train-horovodrun.sbatch (bash): run the launcher, hand Slurm's stop
# signal to it, and requeue the job after a checkpointed stop.
#
#   run_and_requeue SIGNAL COMMAND...
#
# COMMAND (srun, or hvdtrain launch) runs in the background while this shell waits: a shell that
# waits on a foreground command cannot act on a signal until the command ends. SIGTERM or SIGUSR1
# to this shell (`#SBATCH --signal=B:TERM@120` ahead of the time limit, `scancel --batch
# --signal=TERM`, a preemption, `scontrol requeue`) is handed to COMMAND as SIGNAL, and its name
# is written into the stop file $HVDTRAIN_STOP_FILE (in a folder only this user can write to),
# which the ranks also read: a rank still starting, or one its launcher cannot reach yet, stops at
# its first step all the same. The ranks stop at the next step, checkpoint, and exit 75. A second
# signal while the first is handled is absorbed. A signal that came before COMMAND started (the
# script sets `stop_signal` from its first line, see the scripts) ends the job with 75 at once:
# nothing has run, nothing is lost.
#
# Then, by COMMAND's exit code:
#   75   stopped after a checkpoint (a signal, a time limit ahead): `scontrol requeue` puts the job
#        back in the queue (#SBATCH --requeue), where it resumes from the checkpoint, at most
#        HVDTRAIN_MAX_REQUEUES times (default 20; SLURM_RESTART_COUNT counts them), then it ends 75.
#        "requeued" is said when Slurm has the job requeued (by this script, or already by whoever
#        stopped it: `scontrol requeue` from outside, a preemption with requeue).
#   else the job ends with that code: 0 finished, 2 bad configuration or data (or attempts that
#        stop before a step, twice: hvdtrain says how long start-up and a step take, and what --time
#        to ask for), 74 a disk too full for the checkpoint, 1 a crash. None of these is requeued: a
#        retry as it is would not help.
# Nothing is left behind: a COMMAND still running when this shell leaves (an error in the script)
# gets SIGKILL, with every process it started.

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

# How many times Slurm has requeued the job so far (scontrol's Restarts=): one more than the
# attempt's own SLURM_RESTART_COUNT once the job is requeued, by this script or by whoever stopped
# it (`scontrol requeue` from outside, a preemption), while this attempt is still ending. Nothing
# when Slurm does not answer (a busy slurmctld, over about 10 s of tries): unknown is not "0".
# `answer_pause` (seconds between tries; 1, 2, 3 by default) is for the script's tests.
job_restarts() {
    local try shown=""
    for try in 1 2 3 4; do
        shown=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.* Restarts=\([0-9]*\).*/\1/p' | head -1)
        [[ -n $shown || $try == 4 ]] && break
        sleep "${answer_pause:-$try}"
    done
    echo "$shown"
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
    local child code=0 stopping=${stop_signal:-}
    if [[ -n $stopping ]]; then
        echo "$stopping" >"$HVDTRAIN_STOP_FILE"
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$stopping) received before the ranks started:" \
            "nothing to checkpoint, ending with 75" >&2
        code=75
    else
        "$@" &
        child=$!
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
    fi
    # The job is ending: a late signal changes nothing. Ignored, not trapped: the commands below
    # (scontrol, and the subshells they run in) inherit that, and survive the SIGTERM Slurm sends
    # every process of a job it requeues or cancels.
    trap '' TERM USR1
    local restarts=${SLURM_RESTART_COUNT:-0} most=${HVDTRAIN_MAX_REQUEUES:-20} said="" shown asked
    if ((code == 75)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
        shown=$(job_restarts)
        if [[ -n $shown ]] && ((shown > restarts)); then
            say_requeued_already "$shown"
            code=0
        elif ((restarts >= most)); then
            echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75) and was requeued $restarts times" \
                "already (HVDTRAIN_MAX_REQUEUES=$most): not requeued again; submit the same command to continue" >&2
        else
            said=$(scontrol requeue "$SLURM_JOB_ID" 2>&1) && asked=1 || asked=0
            shown=$(job_restarts)
            if [[ -n $shown ]] && ((shown > restarts)); then  # what Slurm shows, not what scontrol returned
                if ((asked)); then
                    echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75): requeued" \
                        "(restart $shown of at most $most); it resumes from the checkpoint" >&2
                else  # ours failed: someone requeued it first ("Job is pending execution")
                    say_requeued_already "$shown"
                fi
                code=0
            elif [[ -z $shown ]]; then
                echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75); Slurm did not answer whether" \
                    "it is requeued (scontrol requeue: ${said:-asked}): see Restarts= in \`scontrol show job" \
                    "$SLURM_JOB_ID\` before you submit the same command to continue" >&2
            else
                echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75) and could not be requeued" \
                    "(${said:-Slurm shows no requeue}: a cancelled job, or #SBATCH --no-requeue); submit the same" \
                    "command to continue" >&2
            fi
        fi
    fi
    return "$code"
}

# A stop signal while COMMAND runs: said once, written to the stop file, handed to COMMAND; a repeat
# (the helper step passing on the same stop, scontrol requeue's second signal) is absorbed.
# `forward_after=SECONDS run_and_requeue ...` (srun): COMMAND gets the signal only once it has run
# that long. srun hands it to every rank at once, and a rank still starting (on a slow file system,
# seconds of Python's own start-up before hvdtrain catches it) ends on SIGUSR1; until then the
# ranks read the stop file, and stop at their first step all the same.
on_stop() {
    local got=$1 forward=$2 child=$3
    interrupted=1
    if [[ -n ${stopping_since:-} ]]; then
        return 0
    fi
    stopping_since=$SECONDS
    echo "$got" >"$HVDTRAIN_STOP_FILE"
    if ((SECONDS - ${launched:-0} >= ${forward_after:-0})); then
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$got) received, passed to the ranks as SIG$forward" >&2
        kill "-$forward" "$child" 2>/dev/null || true
    else
        echo "hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal (SIG$got) received while the ranks start: they read it" \
            "from the stop file" >&2
    fi
}
