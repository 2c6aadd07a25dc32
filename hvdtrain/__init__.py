"""hvdtrain: a Horovod-based distributed trainer for PyTorch."""

__version__ = "0.1.0"
