"""Horovod patch 0008 (third_party/horovod/): horovodrun asks the torch extension what it was
built with once per library, not at every launch (each ask imports torch in a forked process, about
3 s), and keeps the answers in ~/.cache/horovod/built-flags.json under the library's path, size and
modification time."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("horovod.torch")  # each ask forks this process: torch already loaded, it takes ms
util = pytest.importorskip("horovod.common.util")
if not hasattr(util, "_built"):
    pytest.skip("Horovod without hvdtrain's patch 0008 (make setup rebuilds it)", allow_module_level=True)


@pytest.fixture
def asked(tmp_path, monkeypatch):
    """The extensions asked, in order, with the cache under tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[str] = []
    real = util._check_extension_lambda

    def counting(ext_base_name, *args, **kwargs):
        calls.append(ext_base_name)
        return real(ext_base_name, *args, **kwargs)

    monkeypatch.setattr(util, "_check_extension_lambda", counting)
    return calls


def flags_file(tmp_path):
    return tmp_path / "horovod" / "built-flags.json"


def test_the_extension_is_asked_once_and_the_answer_kept_under_the_librarys_stamp(asked, tmp_path):
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert asked == ["torch"]  # no TensorFlow or MXNet library here: not imported, not asked
    (key, value), = json.loads(flags_file(tmp_path).read_text()).items()
    path, size, mtime = key.rsplit(" ", 1)[0].rsplit(":", 2)
    assert path.endswith("mpi_lib_v2" + util.get_ext_suffix()) and key.endswith(" gloo_built") and value is True
    assert int(size) > 0 and int(mtime) > 0
    # The next launch reads the file: no fork, no torch import.
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert asked == ["torch"]
    # Another flag of the same library is a question of its own; both are kept.
    assert util._built("mpi_built", "built with MPI", False) is True
    assert asked == ["torch", "torch"]
    assert sorted(k.rsplit(" ", 1)[1] for k in json.loads(flags_file(tmp_path).read_text())) == ["gloo_built",
                                                                                                 "mpi_built"]


def test_a_rebuilt_library_is_asked_again_and_every_answer_is_kept(asked, tmp_path):
    assert util._built("gloo_built", "built with Gloo", False) is True
    (key, _), = json.loads(flags_file(tmp_path).read_text()).items()
    stamp, name = key.rsplit(" ", 1)
    path, size, mtime = stamp.rsplit(":", 2)
    # The answer recorded for the library as it was before a rebuild (another size) is not used.
    flags_file(tmp_path).write_text(json.dumps({f"{path}:{int(size) + 1}:{mtime} {name}": False}))
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert asked == ["torch", "torch"]
    # Every answer is kept, False as well as True (NCCL: False on a CPU build, True with NCCL ops).
    nccl = util._built("nccl_built", "built with NCCL", False)
    assert nccl in (True, False) and util._built("nccl_built", "built with NCCL", False) is nccl
    assert asked == ["torch"] * 3


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"x": "yes"}'])
def test_a_damaged_cache_is_asked_around_and_rewritten(asked, tmp_path, content):
    flags_file(tmp_path).parent.mkdir(parents=True)
    flags_file(tmp_path).write_text(content)
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert asked == ["torch"]
    assert list(json.loads(flags_file(tmp_path).read_text()).values())[-1] is True


def test_a_cache_folder_that_cannot_be_written_only_costs_the_ask(asked, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # makedirs fails under a file
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert asked == ["torch", "torch"]
    assert not (blocker.parent / "horovod").exists()


def test_verbose_checks_always_ask(asked, tmp_path):
    assert util._built("gloo_built", "built with Gloo", False) is True
    assert util._built("gloo_built", "built with Gloo", True) is True
    assert asked == ["torch", "torch"]
