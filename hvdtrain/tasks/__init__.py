"""Workloads behind one interface: the engine asks the task, and never names images or classes.

- base.py      the interface (``Task``, ``DataEnv``) and the metrics' directions
- registry.py  which class a ``task`` config value names (shipped tasks, ``module:Class``, a class
               handed over in this process), its settings section, and the checkpoint rule
- image_classification.py  the default task; recommendation/ the MovieLens task (task.py), its own
               settings section (settings.py) and its models (models.py)

docs/tasks.md documents the interface (enough to write a task from it alone); docs/architecture.md
follows a step through the modules.
"""

from .base import DIRECTIONS, DataEnv, Task, metric_direction, metric_directions
from .registry import (
    REQUIRED,
    TASKS,
    TASKS_DOC,
    build_task,
    check_task_class,
    checkpoint_task,
    load_file,
    provide,
    provided,
    settings_of,
    task_class,
)

__all__ = ["DIRECTIONS", "DataEnv", "Task", "metric_direction", "metric_directions", "REQUIRED", "TASKS", "TASKS_DOC",
           "build_task", "check_task_class", "checkpoint_task", "load_file", "provide", "provided", "settings_of",
           "task_class"]
