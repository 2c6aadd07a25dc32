#!/bin/bash
# Host discovery script for elastic training (horovodrun --host-discovery-script):
#
#   horovodrun -np 8 --min-np 4 --max-np 16 --host-discovery-script hostfiles/discover-hosts.sh \
#       python -P -m hvdtrain --config imagenet_resnet50 ...
#
# horovodrun runs it every few seconds; it must print the hosts that are available right now, one
# "host:slots" per line, and exit 0. Hosts that disappear are treated as failed, new ones are added
# at the next rendezvous. This example reads a plain list that an operator (or a cluster
# autoscaler hook) edits: HVDTRAIN_HOSTS_FILE, default hostfiles/elastic-hosts.txt, lines
# "host slots=N" or "host:N", '#' comments; hosts that do not answer ssh within 2 s are left out.
# A name that is not a host name (one starting with '-' would reach ssh and mpirun as an option,
# e.g. -oProxyCommand=...; horovodrun puts the names into shell command lines) is left out, with a
# line on stderr.
set -euo pipefail

list=${HVDTRAIN_HOSTS_FILE:-$(dirname "$0")/elastic-hosts.txt}
[[ -r $list ]] || { echo "discover-hosts.sh: cannot read $list" >&2; exit 1; }
while read -r host rest; do
    [[ -z $host || $host == \#* ]] && continue
    if [[ $host == *:* ]]; then
        slots=${host#*:}; host=${host%%:*}
    elif [[ $rest =~ slots=([0-9]+) ]]; then
        slots=${BASH_REMATCH[1]}
    else
        slots=1
    fi
    if [[ ! $host =~ ^[A-Za-z0-9_][A-Za-z0-9._@-]*$ ]]; then
        echo "discover-hosts.sh: skipping '$host' in $list: not a host name (letters, digits, '.', '-', '_', not starting with '-')" >&2
        continue
    fi
    # A cheap liveness check, so that a powered-off machine is not handed to the rendezvous.
    if [[ -n ${HVDTRAIN_DISCOVERY_NO_SSH:-} ]] || \
       ssh -o BatchMode=yes -o ConnectTimeout=2 -- "$host" true </dev/null >/dev/null 2>&1; then
        echo "$host:$slots"
    fi
done <"$list"
