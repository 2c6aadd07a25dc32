"""``hvdtrain ray`` without a cluster: rank assignment, the ranks' environment against what
horovodrun's Gloo mode sets, argument errors and the one line without Ray installed. The real
cluster runs are in tests/parallel/test_ray.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdtrain.comm import launcher_env as launcher
from hvdtrain.launch.ray import (
    Placement,
    RayLaunchError,
    assign_ranks,
    describe_exit,
    host_names,
    node_gpus,
    parse_args,
    rank_env,
)
from tests.helpers import REPO


def place(node: str, ip: str, gpus: tuple[str, ...] = ()) -> Placement:
    return Placement(node_id=node * 8, ip=ip, iface="eth0", gpus=list(gpus))


def test_ranks_are_contiguous_per_node_with_horovodruns_local_and_cross_ranks():
    # Bundles landed A, B, A, C, B: ranks go A, A, B, B, C (nodes in the order of their first bundle).
    placements = [place("a", "10.0.0.1"), place("b", "10.0.0.2"), place("a", "10.0.0.1"), place("c", "10.0.0.3"),
                  place("b", "10.0.0.2")]
    slots = assign_ranks(placements)
    table = [(s.rank, s.actor, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size) for s in slots]
    assert table == [
        (0, 0, "10.0.0.1", 0, 2, 0, 3, 5),
        (1, 2, "10.0.0.1", 1, 2, 0, 2, 5),   # local rank 1 exists on a and b only: cross size 2
        (2, 1, "10.0.0.2", 0, 2, 1, 3, 5),
        (3, 4, "10.0.0.2", 1, 2, 1, 2, 5),
        (4, 3, "10.0.0.3", 0, 1, 2, 3, 5),
    ]


def test_two_ray_nodes_on_one_ip_stay_two_hosts():
    names = host_names([place("a", "127.0.0.1"), place("b", "127.0.0.1"), place("c", "10.0.0.3")])
    assert names == {"a" * 8: "127.0.0.1-aaaaaaaa", "b" * 8: "127.0.0.1-bbbbbbbb", "c" * 8: "10.0.0.3"}


def test_rank_env_has_every_variable_horovodruns_gloo_mode_sets():
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars

    slot = assign_ranks([place("a", "10.0.0.1", ("3",)), place("a", "10.0.0.1", ("1",))])[1]
    env = rank_env(slot, "eth0", "10.0.0.9", 26400, ["3", "1"])
    expected = {**create_slot_env_vars(SlotInfo("10.0.0.1", 1, 1, 0, 2, 2, 1)),
                **create_run_env_vars("10.0.0.9", ["eth0"], 26400)}
    assert {key: str(value) for key, value in expected.items()}.items() <= env.items()
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1"  # local rank 1 -> device 1 -> physical GPU 1

    with pytest.MonkeyPatch.context() as patch:  # hvdtrain's own launcher reading sees the same place
        for key, value in env.items():
            if key.startswith("HOROVOD_"):
                patch.setenv(key, value)
        assert (launcher.rank(), launcher.size(), launcher.local_rank(), launcher.host_name()) == (1, 2, 1, "10.0.0.1")


def test_node_gpus_follow_local_rank_order():
    placements = [place("a", "10.0.0.1", ("2",)), place("b", "10.0.0.2", ("0",)), place("a", "10.0.0.1", ("0",))]
    slots = assign_ranks(placements)
    assert dict(node_gpus(slots, placements)) == {"10.0.0.1": ["2", "0"], "10.0.0.2": ["0"]}


def test_arguments():
    options = parse_args(["-np", "2", "--gpus-per-rank", "1", "--resource", "hvd_slot=1", "--strategy", "spread",
                          "--", "--config", "demo", "train.epochs=1"])
    assert options.np == 2 and options.strategy == "spread"
    assert options.bundle == {"CPU": 1, "GPU": 1, "hvd_slot": 1}
    assert options.program == ["-m", "hvdtrain", "train", "--config", "demo", "train.epochs=1"]
    assert parse_args(["-np", "1", "--script", "probe.py", "--", "out"]).program == ["probe.py", "out"]
    with pytest.raises(RayLaunchError, match="nothing to train"):
        parse_args(["-np", "2"])
    with pytest.raises(RayLaunchError, match="NAME=AMOUNT"):
        parse_args(["-np", "2", "--resource", "slot", "--", "--config", "demo"])
    assert describe_exit(-9) == "signal SIGKILL" and describe_exit(3) == "exit status 3"


def test_without_ray_installed_one_line_says_how_to_install():
    code = ("import sys; sys.modules['ray'] = None; from hvdtrain.cli import main; "
            "sys.exit(main(['ray', '-np', '2', '--', '--config', 'debug']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hvdtrain ray: error: Ray is not installed: pip install -e .[ray] (or make setup EXTRAS=ray)"]


def test_a_bad_key_stops_before_the_cluster_is_asked():
    code = ("import sys; sys.modules['ray'] = None; from hvdtrain.cli import main; "
            "sys.exit(main(['ray', '-np', '2', '--', '--config', 'debug', 'train.epoch=1']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown config key 'train.epoch'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_aws_cluster_config_validates_against_rays_own_schema():
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray]): its schema comes with it")
    import json
    from pathlib import Path

    import jsonschema
    import ray
    import yaml

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((REPO / "hostfiles" / "ray" / "aws-gpu.yaml").read_text())
    jsonschema.validate(config, schema)
    workers = config["available_node_types"]["gpu_worker"]
    assert workers["node_config"]["InstanceMarketOptions"] == {"MarketType": "spot"}
    assert config["available_node_types"]["head"]["resources"] == {"CPU": 0}
    bad = dict(config, max_workers="two")
    with pytest.raises(jsonschema.ValidationError):  # the schema does check
        jsonschema.validate(bad, schema)
