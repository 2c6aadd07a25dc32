#!/usr/bin/env bash
# A shared install: one venv that every user of a cluster runs (docs/launching.md#a-shared-install).
# scripts/setup.sh sources this file; the tests run it directly:
#
#   bash scripts/shared-install.sh python-check PYTHON
#       -> exit 0 when other users can run PYTHON (its real binary, standard library and libpython),
#          else one line naming the first folder or file they cannot enter or read, exit 1
#   bash scripts/shared-install.sh install VENV_PYTHON editable|copy [EXTRAS]
#       -> installs hvdtrain from this checkout into the venv of VENV_PYTHON, no dependencies
#
# Why: a venv's bin/python is a link to the Python it was made with, and its standard library stays
# there. A venv made by root with pyenv's Python (under /root, mode 700) fails for every other user
# with "Permission denied" (exit 126) before hvdtrain is imported. And an editable install (pip -e)
# runs the checkout's files as they change: on a shared install, the installed files (a copy) are
# what users run, and `make setup` again after `git pull` updates them.

# The first path on the way to PYTHON's binary, standard library or libpython that users other than
# its owner cannot enter (folders) or read (files), as "PATH (mode NNN)"; empty when there is none.
closed_to_others() {
    "$1" - <<'EOF'
import os, stat, sys, sysconfig

needed = [os.path.realpath(sys.executable), os.path.realpath(sysconfig.get_paths()["stdlib"])]
library = sysconfig.get_config_var("LDLIBRARY") or ""
if sysconfig.get_config_var("Py_ENABLE_SHARED") and library:
    needed.append(os.path.realpath(os.path.join(sysconfig.get_config_var("LIBDIR") or "", library)))
for path in needed:
    if not os.path.exists(path):
        continue
    steps = [path]
    while os.path.dirname(steps[-1]) != steps[-1]:
        steps.append(os.path.dirname(steps[-1]))
    for step in reversed(steps):
        mode = os.stat(step).st_mode
        want = stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH
        if not mode & want:
            print(f"{step} (mode {stat.S_IMODE(mode):o})")
            sys.exit(0)
EOF
}

# The line that refuses PYTHON for a shared install, or nothing when others can run it.
python_problem() {
    local python=$1 closed
    closed=$(closed_to_others "$python") || { echo "cannot run the Python '$python' (PYTHON=...)"; return; }
    [[ -z $closed ]] && return
    echo "the Python '$python' lives where other users cannot read it ($closed), so the venv made from it would fail for them with 'Permission denied': choose a Python they can read, e.g. PYTHON=/usr/bin/python3 or a module's (module load python), or open that folder to them"
}

# Installs hvdtrain from REPO into the venv of VPY: editable (pip -e, the checkout's files) or
# copy (pip install of a copy of the package). The copy is built from a temporary folder: pip
# builds in the source tree, and the checkout may be someone else's (root's) and read-only.
# A copy install also gets the Slurm batch scripts under VENV/share/hvdtrain/slurm, where they find
# the venv from their own location (hostfiles/slurm/train.sbatch).
install_hvdtrain() {
    local vpy=$1 mode=$2 extras=${3:-} repo src venv
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    venv=$(cd "$(dirname "$vpy")/.." && pwd)
    if [[ $mode == editable ]]; then
        "$vpy" -m pip install -q --no-deps --no-build-isolation -e "$repo"
        [[ -z $extras ]] || "$vpy" -m pip install -q --no-build-isolation -e "$repo[$extras]"
        return
    fi
    src=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$src'" RETURN
    cp "$repo/pyproject.toml" "$repo/README.md" "$src/"
    cp -r "$repo/hvdtrain" "$src/"
    find "$src" -name __pycache__ -prune -exec rm -rf {} +
    "$vpy" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$src"
    [[ -z $extras ]] || "$vpy" -m pip install -q --no-build-isolation "$src[$extras]"
    install_slurm_scripts "$repo" "$venv"
    chmod -R a+rX "$venv"
}

# The Slurm batch scripts into VENV/share/hvdtrain/slurm, with the install's path recorded in them
# (installed_python=, installed_scripts=): a user's copy of one finds the install from anywhere.
install_slurm_scripts() {
    local repo=$1 venv=$2 folder=$2/share/hvdtrain/slurm
    mkdir -p "$folder"
    cp "$repo"/hostfiles/slurm/*.sbatch "$repo"/hostfiles/slurm/*.sh "$folder/"
    if [[ $venv =~ ^[A-Za-z0-9_./+-]+$ ]]; then  # a path sed and the shell take as it is
        sed -i -e "s|^installed_python=\"\"\$|installed_python=$venv/bin/python|" \
            -e "s|^installed_scripts=\"\"\$|installed_scripts=$folder|" "$folder"/*.sbatch
    fi
}

# What a copy install must compare to notice a changed checkout (setup's stamp).
hvdtrain_sources_hash() {
    local repo
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    (cd "$repo" && find hvdtrain hostfiles/slurm -name __pycache__ -prune -o -type f -print0 | sort -z |
        xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    set -euo pipefail
    case ${1:-} in
        python-check)
            problem=$(python_problem "$2")
            [[ -z $problem ]] || { echo "$problem" >&2; exit 1; } ;;
        install) install_hvdtrain "$2" "$3" "${4:-}" ;;
        slurm-scripts) install_slurm_scripts "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" "$2" ;;
        *) echo "usage: $0 python-check PYTHON | install VENV_PYTHON editable|copy [EXTRAS] | slurm-scripts VENV" >&2
           exit 2 ;;
    esac
fi
