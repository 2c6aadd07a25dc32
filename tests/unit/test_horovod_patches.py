"""hvdtrain's patches to Horovod 0.28.1 as a series (third_party/horovod/, docs/horovod-patch.md): the
series file lists exactly the patches present; each patch is headed by what it changes, why, what was
measured, which test holds it, what it depends on and where it stands upstream; the series applies,
in order and exactly (no fuzz, no offset), to the pinned sdist through scripts/horovod-patches.sh,
the code setup.sh and the image and device builds run; an item that no longer applies fails by name;
and each patch can be left out alone. The sdist is the one setup keeps (.cache/setup, HVDTRAIN_CACHE)
or HOROVOD_SDIST names; only the files the patches touch are unpacked, into a temporary folder."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "third_party" / "horovod"
SCRIPT = REPO / "scripts" / "horovod-patches.sh"
SETUP = (REPO / "scripts" / "setup.sh").read_text()
VERSION = re.search(r"^horovod_version=(\S+)$", SETUP, re.M)[1]
SDIST_SHA256 = re.search(r"^horovod_sha256=([0-9a-f]{64})$", SETUP, re.M)[1]
FIELDS = ("Description", "Why", "Measured", "Tests", "Depends", "Forwarded", "Upstream")
# Paths of this repository a header may name; each must exist.
REPO_PATH = re.compile(r"\b(?:tests|hvdtrain|benchmarks|scripts|docs)/[\w/.-]*\w")


def series() -> list[str]:
    """The series file's patch names, in order (quilt: blank lines and # comments skipped)."""
    lines = (PATCHES / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def header(name: str) -> dict[str, str]:
    """A patch's header fields (DEP-3 style: `Field: text`, continued on lines that start with a
    space), from the text before its first file."""
    text = (PATCHES / name).read_text().split("\n--- a/", 1)[0]
    fields: dict[str, str] = {}
    field = None
    for line in text.splitlines():
        found = re.match(r"([A-Z][A-Za-z-]*): ?(.*)$", line)
        if found:
            field = found[1]
            fields[field] = found[2].strip()
        elif line.startswith(" ") and field:
            fields[field] += " " + line.strip()
    return fields


def touched(name: str) -> list[str]:
    """The files a patch changes, as paths inside the sdist's folder."""
    return [line[len("+++ b/"):].split("\t")[0].strip()
            for line in (PATCHES / name).read_text().splitlines() if line.startswith("+++ b/")]


def pinned_sdist() -> Path | None:
    """The sdist setup.sh builds from: HOROVOD_SDIST, else the one setup's cache keeps."""
    cache = Path(os.environ.get("HVDTRAIN_CACHE") or REPO / ".cache" / "setup")
    for candidate in (os.environ.get("HOROVOD_SDIST"), cache / f"horovod-{VERSION}.tar.gz"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@pytest.fixture(scope="module")
def sources() -> dict[str, bytes]:
    """The sdist's copies of every file the series touches, read once."""
    sdist = pinned_sdist()
    if sdist is None:
        pytest.skip(f"no horovod-{VERSION}.tar.gz here (make setup keeps one in .cache/setup; or set HOROVOD_SDIST)")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    assert digest == SDIST_SHA256, f"{sdist} has sha256 {digest}, not the pinned sdist's {SDIST_SHA256}"
    paths = sorted({path for name in series() for path in touched(name)})
    with tarfile.open(sdist) as tar:
        return {path: tar.extractfile(f"horovod-{VERSION}/{path}").read() for path in paths}


def unpack(sources: dict[str, bytes], folder: Path) -> Path:
    """The touched files, as the sdist has them, under folder/horovod-VERSION."""
    root = folder / f"horovod-{VERSION}"
    for path, data in sources.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return root


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_series_lists_exactly_the_patches_in_its_folder():
    names = series()
    assert len(names) == len(set(names)), f"a patch is listed twice in {PATCHES / 'series'}"
    present = {path.name for path in PATCHES.iterdir()} - {"series"}
    assert present == set(names), (f"listed but missing: {sorted(set(names) - present)}; present but not "
                                   f"listed (or not a patch): {sorted(present - set(names))}")
    assert all(name.endswith(".patch") for name in names)
    listed = run_script("list")
    assert listed.returncode == 0, listed.stderr
    assert [Path(line).name for line in listed.stdout.splitlines()] == names  # what setup applies, in order


@pytest.mark.parametrize("name", series())
def test_every_patch_is_headed_by_what_why_measured_and_its_test(name):
    fields = header(name)
    missing = [field for field in FIELDS if not fields.get(field)]
    assert not missing, f"{name}: header fields missing or empty: {missing} (docs/horovod-patch.md, 'Adding a patch')"
    named = REPO_PATH.findall((PATCHES / name).read_text().split("\n--- a/", 1)[0])
    assert not [path for path in named if not (REPO / path).exists()], f"{name} names files that do not exist"
    assert re.search(r"\btests/\S+\.py", fields["Tests"]), f"{name}: Tests names no test file"
    earlier = series()[:series().index(name)]
    depends = fields["Depends"]
    if not depends.startswith("none"):
        listed = re.findall(r"\b\d{4}-[\w.-]+\.patch\b", depends)
        assert listed and set(listed) <= set(earlier), f"{name}: Depends must name patches earlier in the series"
    # Nothing in a header that patch would read as the start of a diff.
    text = (PATCHES / name).read_text().split("\n--- a/", 1)[0]
    assert not re.search(r"^(---|\+\+\+|@@|\*\*\*|diff |Index:)", text, re.M), f"{name}: header line looks like a diff"


def test_the_series_applies_in_order_and_exactly_to_the_pinned_sdist(sources, tmp_path):
    root = unpack(sources, tmp_path)
    result = run_script("apply", str(root))
    assert result.returncode == 0, result.stderr  # "horovod-patches: NAME does not apply to ...", patch's lines
    inexact = [line for line in result.stdout.splitlines() if re.search(r"offset|fuzz", line, re.I)]
    assert not inexact, f"refresh these patches against the series before them: {inexact}"
    assert {line.split(":", 1)[0] for line in result.stdout.splitlines()} == set(series())
    leftovers = [path for path in root.rglob("*") if path.suffix in (".orig", ".rej")]
    assert not leftovers
    for path, data in sources.items():
        assert (root / path).read_bytes() != data, f"{path} is unchanged"


@pytest.mark.parametrize("name", series())
def test_an_item_that_no_longer_applies_fails_by_name(name, sources, tmp_path):
    """An upstream change under a patch (here: the first line its first hunk reads, altered) stops
    the apply with that patch's name; fuzz does not paper over it."""
    root = unpack(sources, tmp_path)
    path = touched(name)[0]
    hunk = (PATCHES / name).read_text().split(f"+++ b/{path}\n", 1)[1]
    first_line = int(re.search(r"^@@ -(\d+)", hunk, re.M)[1])
    read = next(line[1:] for line in hunk.split("\n")[1:] if line[:1] in (" ", "-"))
    lines = (root / path).read_text().split("\n")
    # That line in the sdist's copy: where the hunk says, or, when an earlier patch changes the same
    # file above it, the same line as many lines away as that patch moved it.
    at = min((i for i, line in enumerate(lines) if line == read), key=lambda i: abs(i - (first_line - 1)))
    lines[at] += " changed upstream"
    (root / path).write_text("\n".join(lines))
    result = run_script("apply", str(root))
    assert result.returncode == 1
    assert result.stderr.startswith(f"horovod-patches: {name} does not apply to {root}:"), result.stderr


@pytest.mark.parametrize("left_out", series())
def test_each_patch_can_be_left_out_alone(left_out, sources, tmp_path):
    """The rest of the series still applies without it (those that declare they depend on it are
    left out with it; leaving a patch out is the user's trade, docs/horovod-patch.md)."""
    root = unpack(sources, tmp_path)
    dependents = {name for name in series() if left_out in header(name)["Depends"]}
    for name in series():
        if name == left_out or name in dependents:
            continue
        result = subprocess.run(["patch", "-d", str(root), "-p1", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                                 "-i", str(PATCHES / name)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, (f"without {left_out}, {name} does not apply: it depends on it (say so in its "
                                        f"Depends and in docs/horovod-patch.md)\n{result.stdout}{result.stderr}")


def test_the_series_id_covers_the_series_file_and_every_patch(tmp_path):
    """setup.sh's rebuild marker and wheel key (horovod_series_id): any changed byte changes it."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    copy = tmp_path / "third_party" / "horovod"
    shutil.copytree(PATCHES, copy)

    def series_id() -> str:
        result = subprocess.run(["bash", str(tmp_path / "scripts" / SCRIPT.name), "id"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0 and re.fullmatch(r"[0-9a-f]{12}\n", result.stdout), result.stderr
        return result.stdout

    seen = {series_id()}
    for name in ["series", *series()]:
        with open(copy / name, "a") as f:
            f.write("\n")
        seen.add(series_id())
    assert len(seen) == len(series()) + 2
    (copy / series()[-1]).unlink()
    result = subprocess.run(["bash", str(tmp_path / "scripts" / SCRIPT.name), "id"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and f"lists {series()[-1]}, which is not there" in result.stderr


def test_setup_and_the_image_and_device_builds_apply_the_series():
    assert 'source "$repo/scripts/horovod-patches.sh"' in SETUP
    stamp = SETUP[SETUP.index("stamp=$(cat"):SETUP.index("| sha256sum", SETUP.index("stamp=$(cat"))]
    assert '"$horovod_patches/series" "${horovod_patch_files[@]}"' in stamp
    assert "patch_id=$(horovod_series_id)" in SETUP and "wheel_key=horovod-$horovod_version-$patch_id-" in SETUP
    assert 'apply_horovod_series "$src"' in SETUP
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert dockerfile.count("COPY scripts/shared-install.sh scripts/horovod-patches.sh scripts/torch-wheels.sh "
                            "/opt/hvdtrain/src/scripts/") == 2  # what setup.sh sources
    assert dockerfile.count("COPY third_party /opt/hvdtrain/src/third_party") == 2
    device = (REPO / "benchmarks" / "gpu" / "setup_device.sh").read_text()
    assert 'source "$repo/scripts/horovod-patches.sh"' in device and "apply_horovod_series" in device
    assert not re.search(r"horovod-0\.28\.1\.patch", SETUP + dockerfile + device)
