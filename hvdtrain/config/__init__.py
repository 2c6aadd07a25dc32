"""Configuration: nested dataclasses, YAML files and dotted command-line overrides.

Precedence is defaults < YAML file < ``key=value`` overrides. Every field has a type and a
docstring-like comment; unknown keys and badly typed values stop with one line that names the
key and what would have been valid.

- sections.py  the core sections about what is trained (model, data, augment, train, optim, amp,
               ema, eval), one dataclass each
- run_sections.py  those about how a job runs (dist, runtime, output, checkpoint, elastic, tracking)
- root.py      ``Config``: the core sections, plus the task's own section (``Task.settings``,
               e.g. ``recommendation.embedding_dim``), and the keys that moved there
- files.py     config files: shipped names, bounded safe YAML
- checks.py    the core sections' checks, each one line
- recipe_checks.py  those of the keys recipes set (augmentation, EMA, optimizers, schedules, target)
- load.py      defaults < file < overrides (``read_config``), the task's section mounted and every
               section checked (``check_config``)

The config imports no other part of hvdtrain (tests/unit/test_house_rules.py): a job's config, whose
task section the tasks' registry names, is loaded by hvdtrain/job_config.py (``load_config``).
"""

from .checks import UPPER_BOUNDS, step_range, validates_after
from .files import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, PACKAGED_CONFIGS, read_config_file, resolve_config_path
from .keys import ConfigError
from .load import (
    apply_mapping,
    apply_override,
    check_config,
    describe_keys,
    dump_yaml,
    flatten,
    from_dict,
    migrate_moved_keys,
    read_config,
    to_dict,
)
from .recipe_checks import float_pair, milestone_epochs, target_value
from .root import MOVED_KEYS, Config, config_type, task_section
from .run_sections import (
    CheckpointConfig,
    DistConfig,
    ElasticConfig,
    MlflowConfig,
    OutputConfig,
    RuntimeConfig,
    TrackingConfig,
    WandbConfig,
)
from .sections import AmpConfig, AugmentConfig, DataConfig, EmaConfig, EvalConfig, ModelConfig, OptimConfig, TrainConfig

__all__ = ["Config", "ConfigError", "read_config", "check_config", "apply_override", "apply_mapping", "from_dict",
           "to_dict", "dump_yaml", "flatten", "describe_keys", "float_pair", "milestone_epochs", "step_range",
           "target_value", "validates_after", "PACKAGED_CONFIGS", "UPPER_BOUNDS", "MAX_CONFIG_BYTES",
           "MAX_CONFIG_DEPTH", "MOVED_KEYS", "config_type", "task_section", "migrate_moved_keys", "read_config_file",
           "resolve_config_path", "AmpConfig", "AugmentConfig", "CheckpointConfig", "DataConfig", "DistConfig",
           "ElasticConfig", "EmaConfig", "EvalConfig", "ModelConfig", "OptimConfig", "OutputConfig", "RuntimeConfig",
           "TrackingConfig", "TrainConfig", "WandbConfig", "MlflowConfig"]
