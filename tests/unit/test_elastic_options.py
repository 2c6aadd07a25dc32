"""Options the elastic loop does not honour are refused in one line instead of being ignored."""

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config


def test_mid_epoch_checkpoints_are_refused_in_elastic_runs():
    with pytest.raises(ConfigError) as caught:
        load_config("debug", ["elastic.enabled=true", "checkpoint.every_steps=5"])
    assert "\n" not in str(caught.value) and "elastic.commit_every_steps" in str(caught.value)
    load_config("debug", ["elastic.enabled=true", "runtime.audit_every=5", "output.progress=true"])
