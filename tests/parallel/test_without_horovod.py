"""An install without Horovod (``make setup ENGINE=torch``, ``pip install .``): the default engine
stops in one line that names both ways out (exit 2, no traceback), and ``dist.engine=torch`` trains
2 ranks under torchrun there, importing no Horovod.

Horovod is taken away as absence looks to Python: a ``sitecustomize`` on the job's PYTHONPATH puts
a finder first on ``sys.meta_path`` that answers every ``horovod`` import with the
``ModuleNotFoundError`` (``No module named 'horovod'``, ``name='horovod'``) that an environment
without the package raises; every other import finds the venv's packages as usual.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import BIN, PROBE, REPO, launch, read_metrics, tiny

HIDE_HOROVOD = '''import sys


class NoHorovod:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "horovod":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoHorovod())
'''


@pytest.fixture
def no_horovod(tmp_path):
    """The environment variables of a job whose Python has no Horovod."""
    folder = tmp_path / "no_horovod"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(HIDE_HOROVOD)
    return {"PYTHONPATH": f"{folder}{os.pathsep}{REPO}"}


def test_horovod_cannot_be_imported_there(no_horovod, tmp_path):
    result = subprocess.run([str(BIN / "python"), "-c", "import horovod.torch"], env={**os.environ, **no_horovod},
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'horovod'", result.stderr


def test_the_default_engine_stops_in_one_line(no_horovod, tiny_data, tmp_path):
    result = launch("single", 1, ["-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "run"), tmp_path, check=False,
                    env=no_horovod, own_launch=True)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        "hvdtrain: error: dist.engine=horovod (the default) needs Horovod, which this Python does not have: set "
        "dist.engine=torch and launch with torchrun, or install Horovod with make setup "
        "(docs/launching.md#two-engines)"], result.stderr[-3000:]


def test_the_torch_engine_trains_there(no_horovod, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    result = launch("torchrun", 2, [str(PROBE), str(tmp_path / "probe")]
                    + tiny(tiny_data, run_dir, "dist.engine=torch", "train.steps_per_epoch=2", "train.batch_size=4",
                           "output.tensorboard=false"), tmp_path, env=no_horovod, own_launch=True)
    import torch

    probes = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(p["rank"], p["size"], p["horovod_modules"]) for p in probes] == [(0, 2, []), (1, 2, [])]
    assert "hvdtrain: 2 ranks on 1 host(s) (torch engine, gloo backend)" in result.stdout, result.stdout[-2000:]
    # 2 steps x 4 images x 2 ranks = 16 training images an epoch; all 21 validation images once each
    assert [(r["split"], r["samples"]) for r in read_metrics(run_dir)] == [
        ("train", 16), ("val", 21), ("train", 16), ("val", 21)], result.stdout[-2000:]
