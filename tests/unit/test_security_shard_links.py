"""A shard set another user shares: a shard name that is a link (out of data.dir, to a file of the
victim's) is refused in one line with exit code 65 before training, and a shard swapped for a link
after that check is not read through it (``O_NOFOLLOW``). The other user is made with ``useradd``
(tests/users.py)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hvdtrain import outcome
from hvdtrain.data import DamagedData
from hvdtrain.data.demo import generate
from hvdtrain.data.shards.manifest import open_binary, read_manifest
from hvdtrain.data.shards.read import ShardFailure, read_records
from hvdtrain.ownership import UMASK
from hvdtrain.tools.prepare import prepare
from tests import users


@pytest.fixture
def shared_shards(tmp_path):
    """(the scratch folder, the attacker's shard set in it, a private file of the victim's)."""
    if users.why_not():
        pytest.skip(users.why_not())
    attacker = users.user()
    folder = users.scratch()
    generate(tmp_path / "src", train_per_class=4, val_per_class=2, size=16, num_classes=2)
    shards = folder / "shards"
    prepare(tmp_path / "src", shards, shard_size_mb=0.005, progress=False, share=UMASK)  # published data
    for path in [shards, *shards.iterdir()]:
        os.chown(path, attacker.pw_uid, attacker.pw_gid)
    home = users.victim_home(folder)
    secret = home / "private.bin"
    secret.write_bytes(b"victim's secret " * 65536)  # 1 MB: room for any count the manifest claims
    secret.chmod(0o600)
    yield folder, shards, secret
    shutil.rmtree(folder)


def test_a_shard_that_is_a_link_out_of_data_dir_is_one_line_and_exit_65(shared_shards, capsys):
    folder, shards, secret = shared_shards
    assert read_manifest(str(shards)).train.size == 8
    users.as_user(users.ATTACKER, f"rm {shards}/train-000000.tar && ln -s {secret} {shards}/train-000000.tar",
                  cwd=folder)
    with pytest.raises(DamagedData) as refused:
        read_manifest(str(shards))
    line = str(refused.value)
    assert line.startswith(f"{shards}/train-000000.tar is a link (to {secret}): a shard set's files are read only "
                           f"as files inside data.dir, never through a link") and "\n" not in line
    assert outcome.report_error(refused.value) == 65
    assert capsys.readouterr().err == f"hvdtrain: error: {line}\n"


def test_a_shard_swapped_for_a_link_after_the_check_is_not_read(shared_shards):
    folder, shards, secret = shared_shards
    manifest = read_manifest(str(shards))
    name = manifest.train.names[0]
    users.as_user(users.ATTACKER, f"rm {shards}/{name} && ln -s {secret} {shards}/{name}", cwd=folder)
    with pytest.raises(OSError) as refused:
        open_binary(str(shards / name))
    assert refused.value.errno == errno.ELOOP
    wanted = set(range(int(manifest.train.counts[0])))
    read = list(read_records(str(shards), manifest.train, np.array(sorted(wanted), dtype=np.int64), wanted))
    assert len(read) == len(wanted) and all(isinstance(data, ShardFailure) for _, _, data, _ in read)
    assert {data.path for _, _, data, _ in read} == {str(Path(shards) / name)}
