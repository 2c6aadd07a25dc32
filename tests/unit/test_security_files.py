"""Files others can write or link: the MovieLens ratings cache, ``hvdtrain
prepare``'s source files and destination (never another user's unfinished run), symlink loops in a
data folder, and temporary files in cache folders."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data.demo import generate
from hvdtrain.data.files.index import DataError, LayoutError, build_index, scan_split
from hvdtrain.data.ratings.movielens import CSV_HEADER, load_split
from hvdtrain.ownership import UMASK
from hvdtrain.tools.prepare import PrepareError, prepare
from tests import users

ROWS = [(u, i, r, 1000 + 10 * u + i) for u in range(1, 21) for i, r in zip(range(1, 9), (3, 4, 5, 2.5, 3.5, 4, 1, 5))]
MEAN = float(np.mean([r for _, _, r, _ in ROWS]))


def write_ratings(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "ratings.csv"
    path.write_text(CSV_HEADER + "\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in ROWS))
    return path


# --- the ratings cache ------------------------------------------------------------------------------

def test_ratings_cache_is_written_under_the_users_cache_not_the_shared_folder(tmp_path):
    shared, private = tmp_path / "shared" / "ml", tmp_path / "home" / ".cache" / "hvdtrain"
    write_ratings(shared)
    split = load_split(shared, "leave_last_out", 0.1, 0, fallback_cache=private)
    assert [p.name for p in shared.iterdir()] == ["ratings.csv"]
    assert split.cache_path.is_relative_to(private)
    assert split.cache_path.stat().st_mode & 0o077 == 0 and (private / "movielens").stat().st_mode & 0o077 == 0


def test_a_link_planted_at_the_old_temporary_name_clobbers_nothing(tmp_path):
    # Another user of the shared folder plants links at every name the old code would write through.
    shared = tmp_path / "shared" / "ml"
    path = write_ratings(shared)
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's file")
    from hvdtrain.data.ratings.movielens import cache_key

    for split, fraction in (("leave_last_out", 0.1), ("random", 0.1)):
        old_name = f".{path.name}.hvdtrain-{cache_key(path, split, fraction, 0, 'fail')}.npz"
        (shared / f"{old_name}.tmp-{os.getpid()}.npz").symlink_to(victim)
        (shared / old_name).symlink_to(victim)
        load_split(shared, split, fraction, 0, fallback_cache=tmp_path / "cache")
    assert victim.read_text() == "the victim's file"


def test_a_source_changed_with_the_same_size_and_mtime_is_parsed_again(tmp_path):
    shared = tmp_path / "ml"
    path = write_ratings(shared)
    first = load_split(shared, "random", 0.1, 0, fallback_cache=tmp_path / "cache")
    assert float(first.ratings.ratings.mean()) == pytest.approx(MEAN)
    stat = path.stat()
    text = path.read_text()
    path.write_text(text.replace(",3,", ",1,"))  # every 3-star rating is now 1 star: same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    second = load_split(shared, "random", 0.1, 0, fallback_cache=tmp_path / "cache")
    assert not second.from_cache and float(second.ratings.ratings.mean()) < MEAN - 0.1


def test_a_cache_file_others_can_write_is_not_trusted(tmp_path):
    shared = tmp_path / "ml"
    write_ratings(shared)
    cache = tmp_path / "cache"
    first = load_split(shared, "random", 0.1, 0, fallback_cache=cache)
    # Someone rewrites the cache (keeping every field, the signature included) with half-star ratings.
    with np.load(first.cache_path) as saved:
        fields = {key: saved[key] for key in saved.files}
    fields["ratings"] = np.full_like(fields["ratings"], 0.5)
    with open(first.cache_path, "wb") as handle:
        np.savez(handle, **fields)
    os.chmod(first.cache_path, 0o666)
    second = load_split(shared, "random", 0.1, 0, fallback_cache=cache)
    assert float(second.ratings.ratings.mean()) == pytest.approx(MEAN)  # not 0.5
    assert not second.from_cache
    assert load_split(shared, "random", 0.1, 0, fallback_cache=cache).from_cache  # rewritten, ours again


# --- prepare ---------------------------------------------------------------------------------------

@pytest.fixture
def source(tmp_path) -> Path:
    root = tmp_path / "src"
    generate(root, train_per_class=3, val_per_class=2, size=16, num_classes=2)
    return root


def shard_bytes(dst: Path) -> bytes:
    found = b""
    for shard in sorted(dst.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                found += tar.extractfile(member).read()
    return found


SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"


def test_prepare_refuses_a_link_that_leaves_the_source(source, tmp_path):
    key = tmp_path / "home" / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_bytes(SECRET)
    train_class = sorted((source / "train").iterdir())[0]
    (train_class / "zz_planted.jpg").symlink_to(key)
    with pytest.raises(PrepareError) as error:
        prepare(source, tmp_path / "out", progress=False)
    message = str(error.value)
    assert "\n" not in message and "zz_planted.jpg" in message and "--follow-links" in message
    assert not list((tmp_path / "out").glob("*.tar"))


def test_prepare_refuses_a_linked_folder_that_leaves_the_source(source, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x.jpg").write_bytes(SECRET)
    (sorted((source / "val").iterdir())[0] / "more").symlink_to(outside)
    with pytest.raises(PrepareError, match="lead outside .* through links"):
        prepare(source, tmp_path / "out", progress=False)


def test_follow_links_takes_outside_images_but_never_non_images(source, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    image = sorted((source / "train").rglob("*.JPEG"))[0]
    (outside / "photo.jpg").write_bytes(image.read_bytes())
    (outside / "id_rsa.jpg").write_bytes(SECRET)
    train_class = sorted((source / "train").iterdir())[0]
    (train_class / "linked_photo.jpg").symlink_to(outside / "photo.jpg")
    (train_class / "linked_key.jpg").symlink_to(outside / "id_rsa.jpg")
    manifest = prepare(source, tmp_path / "out", progress=False, follow_links=True)
    assert manifest["splits"]["train"]["images"] == 2 * 3 + 1
    assert SECRET not in shard_bytes(tmp_path / "out")
    assert [entry for entry in manifest["skipped"] if "linked_key.jpg" in entry and "not an image" in entry]


def test_prepare_copies_only_images_without_max_side(source, tmp_path):
    train_class = sorted((source / "train").iterdir())[0]
    (train_class / "notes.jpg").write_bytes(SECRET)  # a text file with an image's name
    (train_class / "half.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 10)
    manifest = prepare(source, tmp_path / "out", progress=False)
    assert SECRET not in shard_bytes(tmp_path / "out")
    assert manifest["splits"]["train"]["images"] == 2 * 3
    assert sorted(Path(entry.split(" (")[0]).name for entry in manifest["skipped"]) == ["half.png", "notes.jpg"]


# --- symlink loops -------------------------------------------------------------------------------

def test_a_symlink_loop_stops_the_scan_with_one_line(source, tmp_path):
    train_class = sorted((source / "train").iterdir())[0]
    (train_class / "again").symlink_to(train_class)
    start = time.monotonic()
    with pytest.raises(LayoutError) as error:
        scan_split(source / "train")
    assert time.monotonic() - start < 5
    message = str(error.value)
    assert "\n" not in message and "symlink loop" in message and str(train_class / "again") in message
    # The same line from the training index and from prepare.
    with pytest.raises(LayoutError, match="symlink loop"):
        build_index(source, None)
    with pytest.raises(PrepareError, match="symlink loop"):
        prepare(source, tmp_path / "out", progress=False)


def test_a_loop_through_a_parent_is_found_too(source, tmp_path):
    nested = sorted((source / "val").iterdir())[0] / "a" / "b"
    nested.mkdir(parents=True)
    (nested / "up").symlink_to(nested.parent.parent)
    with pytest.raises(DataError, match="symlink loop"):
        scan_split(source / "val")


def test_links_without_a_loop_are_still_followed(source, tmp_path):
    # A class folder linked in from elsewhere (datasets assembled with links): ImageFolder's listing.
    elsewhere = tmp_path / "extra_images"
    elsewhere.mkdir()
    image = sorted((source / "train").rglob("*.JPEG"))[0]
    (elsewhere / "e.jpg").write_bytes(image.read_bytes())
    train_class = sorted((source / "train").iterdir())[0]
    (train_class / "extra").symlink_to(elsewhere)
    index = scan_split(source / "train")
    assert f"{train_class.name}/extra/e.jpg" in index.paths and len(index) == 2 * 3 + 1


# --- temporary files in cache folders --------------------------------------------------------------

def test_the_file_index_cache_is_not_written_through_a_planted_link(source, tmp_path):
    from hvdtrain.data.files.index import cache_file

    cache = tmp_path / "cache"
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's file")
    target = cache_file(source, cache)
    target.parent.mkdir(parents=True)
    target.with_name(f"{target.name}.tmp-{os.getpid()}").symlink_to(victim)
    build_index(source, cache)
    assert victim.read_text() == "the victim's file"
    assert target.read_bytes().startswith(b"hvdtrain-file-index")
    assert build_index(source, cache).source == "cache"


def test_prepare_output_modes_follow_the_umask(source, tmp_path):
    # Shards shared with everyone (--share everyone) are created under a private temporary name, then
    # get the mode a plain create gives (private ones: tests/unit/test_security_prepare.py).
    previous = os.umask(0o022)
    try:
        prepare(source, tmp_path / "out", progress=False, share=UMASK)
    finally:
        os.umask(previous)
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path
    assert not list((tmp_path / "out").glob(".*"))


# --- prepare's destination: never another user's unfinished run -----------------------------------

def test_prepare_never_adopts_another_users_unfinished_run(source, tmp_path):
    if users.why_not():
        pytest.skip(users.why_not())
    uid = users.user().pw_uid
    dst = tmp_path / "dst"
    prepare(source, dst, progress=False)
    options = json.loads((dst / "manifest.json").read_text())["options"]
    shutil.rmtree(dst)
    # Her unfinished run: the options of ours, a sidecar and a shard of hers with swapped labels.
    dst.mkdir(mode=0o755)
    (dst / ".prepare").mkdir(mode=0o755)
    (dst / ".prepare" / "options.json").write_text(json.dumps({"format": "hvdtrain-shards-v1", "options": options}))
    for path in (dst, dst / ".prepare", dst / ".prepare" / "options.json"):
        os.chown(path, uid, -1)
    with pytest.raises(PrepareError) as error:
        prepare(source, dst, progress=False)
    assert f"belongs to {users.ATTACKER}" in str(error.value) and "\n" not in str(error.value)
    os.chown(dst, 0, -1)  # the folders are ours, her marker is not
    os.chown(dst / ".prepare", 0, -1)
    with pytest.raises(PrepareError, match=f"is not yours to continue: .*options.json belongs to {users.ATTACKER}"):
        prepare(source, dst, progress=False)


def test_prepare_writes_again_a_shard_that_is_not_the_users(source, tmp_path):
    dst = tmp_path / "dst"
    prepare(source, dst, progress=False)
    reference = {p.name: p.read_bytes() for p in dst.glob("*.tar")}
    manifest = json.loads((dst / "manifest.json").read_text())
    # An interrupted run of ours, whose first shard someone could rewrite meanwhile.
    (dst / "manifest.json").unlink()
    (dst / ".prepare").mkdir()
    options = {"format": "hvdtrain-shards-v1", "options": manifest["options"]}
    (dst / ".prepare" / "options.json").write_text(json.dumps(options))
    shard = manifest["splits"]["train"]["shards"][0]
    (dst / ".prepare" / f"{shard['name']}.json").write_text(json.dumps({**shard, "skipped": []}))
    (dst / shard["name"]).chmod(0o666)
    prepare(source, dst, progress=False)
    assert (dst / shard["name"]).stat().st_mode & 0o777 == 0o600  # written again, privately
    assert {p.name: p.read_bytes() for p in dst.glob("*.tar")} == reference
