# Sourced by train.sbatch and train-horovodrun.sbatch (bash): run the launcher, hand Slurm's stop
# signal to it, and requeue the job after a checkpointed stop.
#
#   run_and_requeue SIGNAL COMMAND...
#
# COMMAND (srun, or hvdtrain launch) runs in the background while this shell waits: a shell that
# waits on a foreground command cannot act on a signal until the command ends. SIGTERM or SIGUSR1
# to this shell (`#SBATCH --signal=B:TERM@120` ahead of the time limit, `scancel --batch
# --signal=TERM`, a preemption) is handed to COMMAND as SIGNAL: the ranks stop at the next step,
# checkpoint, and exit 75.
#
# Then, by COMMAND's exit code:
#   75   stopped after a checkpoint (a signal, a time limit ahead): `scontrol requeue` puts the job
#        back in the queue (#SBATCH --requeue), where it resumes from the checkpoint, at most
#        HVDTRAIN_MAX_REQUEUES times (default 20; SLURM_RESTART_COUNT counts them), then it ends 75.
#   else the job ends with that code: 0 finished, 2 bad configuration or data, 74 a disk too full
#        for the checkpoint, 1 a crash. None of these is requeued: a retry as it is would not help.
# Nothing is left behind: a COMMAND still running when this shell leaves (an error in the script)
# gets SIGKILL, with every process it started.

descendants() {
    local pid
    for pid in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$pid"
        echo "$pid"
    done
}

run_and_requeue() {
    local forward=$1
    shift
    "$@" &
    local child=$! code=0 interrupted
    # shellcheck disable=SC2064  # the child's pid and the signal, fixed now
    trap "interrupted=1; echo \"hvdtrain: job ${SLURM_JOB_ID:-?}: stop signal received, passed to the ranks as SIG$forward\" >&2; kill -$forward $child 2>/dev/null || true" TERM USR1
    trap "kill -KILL \$(descendants $child) $child 2>/dev/null || true" EXIT
    while :; do
        interrupted=0
        wait "$child" && code=0 || code=$?
        ((interrupted)) || break  # a signal interrupts wait: wait again for the real exit code
    done
    trap - TERM USR1
    local restarts=${SLURM_RESTART_COUNT:-0} most=${HVDTRAIN_MAX_REQUEUES:-20}
    if ((code == 75)) && [[ -n ${SLURM_JOB_ID:-} ]]; then
        if ((restarts >= most)); then
            echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75) and was requeued $restarts times" \
                "already (HVDTRAIN_MAX_REQUEUES=$most): not requeued again; submit the same command to continue" >&2
        elif scontrol requeue "$SLURM_JOB_ID"; then
            echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75): requeued" \
                "(restart $((restarts + 1)) of at most $most); it resumes from the checkpoint" >&2
            code=0
        else
            echo "hvdtrain: job $SLURM_JOB_ID stopped after a checkpoint (exit 75) and could not be requeued" \
                "(scontrol requeue failed: a cancelled job, or #SBATCH --no-requeue); submit the same command to continue" >&2
        fi
    fi
    return "$code"
}
