"""Horovod's launcher keeps secrets out of process arguments (the runner hunks of
third_party/horovod/0006). Real launches are in tests/parallel/test_secrets.py (local
ranks) and tests/multinode/test_secrets_ssh.py (ranks over ssh); these check the pieces alone."""

from __future__ import annotations

import threading

from horovod.runner import gloo_run
from horovod.runner.common.util import codec, secret
from horovod.runner.common.util import settings as hvd_settings
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.driver import driver_service

from hvdtrain.tools.doctor import Host, gloo_launcher_hides_env, secrets_note


def test_rank_commands_hold_horovods_variables_but_no_value_of_the_environment():
    slot = SlotInfo(hostname="node1", rank=1, local_rank=0, cross_rank=1, size=2, local_size=1, cross_size=2)
    env = {"WANDB_API_KEY": "k-123", "PATH": "/usr/bin", "OLDPWD": "/x"}
    command = gloo_run._slot_info_to_command_fn("python train.py", env)(slot)
    assert "k-123" not in command and "/usr/bin" not in command
    assert command.startswith("env HOROVOD_HOSTNAME=node1 HOROVOD_RANK=1 ") and command.endswith("python train.py")
    assert gloo_run.rank_env_vars(env) == {"WANDB_API_KEY": "k-123", "PATH": "/usr/bin", "PYTHONUNBUFFERED": "1"}
    script = gloo_run._remote_script(command, {"A_B": "it's\nsecret", "bad-name": "x"})
    assert "export A_B='it'\"'\"'s\nsecret'\n" in script and "bad-name" not in script  # what /bin/sh -s reads
    assert script.rstrip().endswith(f"exec {command}")


def test_the_task_function_gets_the_jobs_secret_key_on_stdin(monkeypatch):
    calls, done = [], threading.Event()

    def execute(command, **kwargs):
        calls.append((command, kwargs))
        done.set()
        return 0

    monkeypatch.setattr(driver_service.safe_shell_exec, "execute", execute)
    settings = hvd_settings.Settings(key=secret.make_secret_key(), verbose=0)
    driver_service._launch_task_servers(["node1"], {"localhost"}, {"lo": [("127.0.0.1", 1234)]}, settings)
    assert done.wait(10)
    command, kwargs = calls[0]
    assert command.startswith("ssh ") and command.rstrip().endswith("-m horovod.runner.task_fn")
    fields = kwargs["stdin_data"].split()
    assert len(fields) == 4 and codec.loads_base64(fields[3]).key == settings.key
    assert fields[3] not in command


def test_the_doctor_names_hosts_whose_gloo_launcher_shows_secrets():
    assert gloo_launcher_hides_env()  # the Horovod installed here carries hvdtrain's patch
    facts = {"gloo_hides_env": True}
    assert secrets_note([Host("a", 1, facts), Host("b", 1, {"gloo_hides_env": False})]).startswith(
        "note: b: this Horovod's horovodrun --gloo puts every environment value (API keys, passwords) in the ranks'")
    assert secrets_note([Host("a", 1, facts)]) is None
