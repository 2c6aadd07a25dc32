#!/usr/bin/env bash
# Horovod's own test suite for PyTorch (test/parallel/test_torch.py of Horovod 0.28.1) against the
# Horovod this venv has (built by setup.sh with the patches of third_party/horovod/), run as Horovod
# runs it: `horovodrun -np 2 -H localhost:2 --gloo python -m pytest test_torch.py`, then `--mpi`.
# `make test-horovod` runs it; docs/horovod-patch.md gives the last result.
#
#   bash scripts/horovod-tests.sh [gloo] [mpi]     (both when none is named)
#
# The suite is not in the project and not in Horovod's sdist (which has no test/ folder): its three
# files are taken at the pinned commit of tag v0.28.1 and checked against their pinned sha256 into
# .cache/horovod-tests/COMMIT/ (ignored), and checked again before every run:
#   HOROVOD_TESTS_SRC=DIR   a Horovod source tree at v0.28.1 (a git checkout, GitHub's tarball):
#                           the files are copied from DIR/test/... (machines without GitHub access)
#   otherwise               downloaded from raw.githubusercontent.com at the pinned commit
# HOROVOD_TESTS_TIMEOUT=S (default 1200): a controller's run that takes longer is a hang and fails.
# HOROVOD_TESTS_OUT=DIR (default runs/horovod-tests): each rank's log and JUnit report.
#
# Verdict per controller (scripts/horovod_tests_verdict.py): every test passes or skips on both
# ranks, except the three that enumerate torch's optimizers and meet Muon, which must fail with its
# error. Any other failure or error, a rank that writes no report (aborted: Horovod's background
# thread dying takes the process with it), an abort in the log, or the timeout fails it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VENV:-$repo/.venv}
[[ $venv = /* ]] || venv=$repo/$venv
timeout_s=${HOROVOD_TESTS_TIMEOUT:-1200}
out=${HOROVOD_TESTS_OUT:-$repo/runs/horovod-tests}
[[ $out = /* ]] || out=$PWD/$out

# Tag v0.28.1 of github.com/horovod/horovod (a lightweight tag on this commit).
commit=1d217b59949986d025f6db93c49943fb6b6cc78f
files=(test/parallel/test_torch.py test/utils/common.py test/conftest.py)
sha256s=(8af114f63fb7a87271322ad2da2c7050c3a9028570e45e8c44e9b1b4cac8db3a
         9844d1041c1e26b34657273608a51a19a94c18e0c22f9aa7971ae78189119290
         c21698c598bb7051ef66d9c57e364c4c775c3f9ff57ee96cb0833d4935a029f1)
# test/utils/common.py imports mock at the top; the venv gets this pin when it lacks it.
mock_pin=mock==5.2.0

log() { printf '[horovod-tests] %s\n' "$*"; }
die() { printf '[horovod-tests] error: %s\n' "$*" >&2; exit 1; }

controllers=("$@")
((${#controllers[@]})) || controllers=(gloo mpi)
for controller in "${controllers[@]}"; do
    [[ $controller == gloo || $controller == mpi ]] || die "controllers are gloo and mpi, not '$controller'"
done
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "HOROVOD_TESTS_TIMEOUT must be a number of seconds, not '$timeout_s'"
[[ -x $venv/bin/horovodrun ]] || die "no horovodrun in $venv: run make setup first (or set VENV)"
py=$venv/bin/python

suite=$repo/.cache/horovod-tests/$commit
sha_ok() { [[ -f $1 && ! -L $1 ]] && [[ $(sha256sum <"$1" | cut -d' ' -f1) == "$2" ]]; }

# The files, each written under a temporary name beside its place and renamed once its sum matches.
mkdir -p "$suite"
for i in "${!files[@]}"; do
    file=${files[$i]} want=${sha256s[$i]}
    sha_ok "$suite/$file" "$want" && continue
    mkdir -p "$suite/$(dirname "$file")"
    tmp=$(mktemp "$suite/$(dirname "$file")/.fetch.XXXXXX")
    if [[ -n ${HOROVOD_TESTS_SRC:-} ]]; then
        [[ -f $HOROVOD_TESTS_SRC/$file ]] || { rm -f "$tmp"; die "no $file in HOROVOD_TESTS_SRC=$HOROVOD_TESTS_SRC (a Horovod source tree at v0.28.1)"; }
        cat -- "$HOROVOD_TESTS_SRC/$file" >"$tmp"
    else
        url=https://raw.githubusercontent.com/horovod/horovod/$commit/$file
        log "downloading $url"
        "$py" - "$url" "$tmp" 2>"$tmp.err" <<'EOF' || { tail -1 "$tmp.err" >&2; rm -f "$tmp" "$tmp.err"; die "cannot download Horovod's test files (no GitHub access?): set HOROVOD_TESTS_SRC to a Horovod source tree at v0.28.1"; }
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as response, open(sys.argv[2], "wb") as f:
    f.write(response.read())
EOF
        rm -f "$tmp.err"
    fi
    got=$(sha256sum <"$tmp" | cut -d' ' -f1)
    [[ $got == "$want" ]] || { rm -f "$tmp"; die "$file from ${HOROVOD_TESTS_SRC:-GitHub} is not v0.28.1's (sha256 $got, pinned $want)"; }
    mv -f -- "$tmp" "$suite/$file"
done
# pytest's rootdir for the suite: the project's pytest.ini and conftest.py stay out of it.
[[ -f $suite/pytest.ini ]] || printf '[pytest]\n' >"$suite/pytest.ini"

"$py" -c 'import mock' 2>/dev/null || {
    log "installing $mock_pin into $venv (Horovod's test/utils/common.py imports it)"
    "$py" -m pip install -q "$mock_pin"
}

failed=()
for controller in "${controllers[@]}"; do
    dir=$out/$controller
    rm -rf "$dir" && mkdir -p "$dir"
    log "$controller: horovodrun -np 2 -H localhost:2 --$controller python -m pytest test_torch.py (log: $dir/horovodrun.log)"
    for i in "${!files[@]}"; do  # again, just before the run: the cache is a folder others may reach
        sha_ok "$suite/${files[$i]}" "${sha256s[$i]}" || die "$suite/${files[$i]} changed since it was checked"
    done
    # Each rank: its own JUnit report; --capture=sys lets a C++ abort's message reach the log.
    rank_cmd="cd $(printf %q "$suite/test/parallel") && exec $(printf %q "$py") -m pytest -p no:cacheprovider"
    rank_cmd+=" --capture=sys -v -rfE test_torch.py --junitxml=$(printf %q "$dir")/rank\${HOROVOD_RANK:-\$OMPI_COMM_WORLD_RANK}.xml"
    start=$SECONDS
    status=0
    PATH=$venv/bin:$PATH timeout --kill-after=30 "$timeout_s" \
        "$venv/bin/horovodrun" -np 2 -H localhost:2 "--$controller" bash -c "$rank_cmd" \
        >"$dir/horovodrun.log" 2>&1 </dev/null || status=$?
    seconds=$((SECONDS - start))
    if ((status == 124 || status == 137)); then
        log "$controller: FAILED: still running after $timeout_s s (a hang); the log ends:"
        tail -20 "$dir/horovodrun.log" >&2
        failed+=("$controller")
        continue
    fi
    "$py" "$repo/scripts/horovod_tests_verdict.py" "$dir" "$controller" "$seconds" || failed+=("$controller")
done
((${#failed[@]} == 0)) || die "Horovod's test_torch.py failed under: ${failed[*]} (logs and reports in $out)"
log "Horovod's test_torch.py passes under: ${controllers[*]}"
