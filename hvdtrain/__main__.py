import sys

# First thing: a scheduler's stop signal during start-up (imports take seconds) must not end the
# process before the training loop can checkpoint (fault/signals.py).
from .fault import signals

signals.catch()

from .cli import main  # noqa: E402 - after the signals are caught

if __name__ == "__main__":
    sys.exit(main())
