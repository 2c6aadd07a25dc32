import sys

# First thing: a scheduler's stop signal during start-up (imports take seconds) must not end the
# process before the training loop can checkpoint (fault/signals.py).
from .fault import signals

signals.catch()

# Next: a module of the user's that hides PyYAML or numpy (on PYTHONPATH: the working folder is not on
# the path, hvdtrain/__init__.py) is named in one line before the imports below would run it.
from .environment import refuse_shadowed  # noqa: E402 - standard library only

refuse_shadowed()

try:
    from .cli import main  # noqa: E402 - after the signals are caught
except (ImportError, AttributeError) as error:  # the CLI's own imports (PyYAML, numpy) hidden by a user's module?
    from .environment import report_import_failure

    report_import_failure(error)  # one line and exit 2 where that is the cause, else the traceback
    raise

if __name__ == "__main__":
    sys.exit(main())
