"""The shard loader's tar reader against Python's tarfile, on the formats writers produce."""

import io
import tarfile

import pytest

from hvdtrain.data.shards.tar import TarError, TarReader

MEMBERS = [("n01440764_10026.jpg", b"\xff\xd8" + bytes(range(256)) * 9), ("n01440764_10026.cls", b"3"),
           ("sub/dir/" + "k" * 120 + ".png", b"png" * 700), ("sub/dir/" + "k" * 120 + ".cls", b"12"),
           ("caf\u00e9.jpg", b""), ("caf\u00e9.cls", b"0\n")]


def archive(fmt: int, members=MEMBERS, directory: bool = True) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        if directory:
            info = tarfile.TarInfo("sub")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


class Unseekable(io.RawIOBase):
    def __init__(self, data: bytes):
        self.inner = io.BytesIO(data)

    def readable(self):
        return True

    def read(self, count=-1):
        return self.inner.read(count)


def read_all(handle) -> list[tuple[str, bytes | None]]:
    reader = TarReader(handle)
    return [(name, reader.read() if is_file else None) for name, is_file in reader]


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["gnu", "pax"])
def test_every_member_and_byte_as_tarfile_reads_them(fmt):
    data = archive(fmt)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read() if m.isfile() else None) for m in tar]
    assert read_all(io.BytesIO(data)) == expected
    assert read_all(Unseekable(data)) == expected
    assert [name for name, _ in expected][:2] == ["sub", "n01440764_10026.jpg"]


def test_ustar_with_a_prefix_field_and_members_left_unread():
    members = [("a" * 90 + "/" + "b" * 60 + f".{ext}", payload)
               for ext, payload in (("jpg", b"x" * 1000), ("cls", b"7"))]
    data = archive(tarfile.USTAR_FORMAT, members, directory=False)
    reader = TarReader(io.BytesIO(data))
    seen = []
    for name, _ in reader:
        seen.append(name)
        if name.endswith(".cls"):
            assert reader.read() == b"7"  # the .jpg was skipped unread
    assert seen == [name for name, _ in members]


def test_a_truncated_or_damaged_archive_raises():
    data = archive(tarfile.USTAR_FORMAT, MEMBERS[:2], directory=False)
    with pytest.raises(TarError, match="unexpected end of data"):
        read_all(io.BytesIO(data[:1500]))
    with pytest.raises(TarError, match="unexpected end of data"):
        read_all(Unseekable(data[:1500]))
    damaged = bytearray(data)
    damaged[10] ^= 0x01  # a byte of the first member's name
    with pytest.raises(TarError, match="checksum"):
        read_all(io.BytesIO(bytes(damaged)))
    with pytest.raises(TarError, match="checksum"):
        read_all(io.BytesIO(b"<html>" + bytes(600)))
    with pytest.raises(TarError, match="not a tar header"):
        read_all(io.BytesIO(b"<html>" + bytes(142) + b"garbage!" + bytes(600)))
