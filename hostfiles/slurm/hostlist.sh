#!/bin/bash
# Print a horovodrun host list ("node-a:8,node-b:8") for the current Slurm allocation.
#
#   hosts=$(bash hostfiles/slurm/hostlist.sh)   # inside an sbatch/salloc allocation
#
# Host names come from `scontrol show hostnames $SLURM_JOB_NODELIST` (which expands
# "node[01-03]"), slots from SLURM_TASKS_PER_NODE, whose compressed form "8(x2),4" means
# 8 tasks on each of the first two nodes and 4 on the third.
set -euo pipefail

mapfile -t nodes < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm allocation}")
counts=()
IFS=, read -ra groups <<<"${SLURM_TASKS_PER_NODE:?not inside a Slurm allocation}"
for group in "${groups[@]}"; do
    if [[ $group =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
        for ((i = 0; i < BASH_REMATCH[2]; i++)); do counts+=("${BASH_REMATCH[1]}"); done
    else
        counts+=("$group")
    fi
done
if ((${#nodes[@]} != ${#counts[@]})); then
    echo "hostlist.sh: ${#nodes[@]} nodes in '$SLURM_JOB_NODELIST' but ${#counts[@]} counts in '$SLURM_TASKS_PER_NODE'" >&2
    exit 1
fi
list=""
for i in "${!nodes[@]}"; do
    list+="${list:+,}${nodes[$i]}:${counts[$i]}"
done
echo "$list"
