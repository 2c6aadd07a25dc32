"""Input pipelines' building blocks: the sampler, loader plumbing, decoding, file lists and their
index, synthetic and demo data. Tasks (``hvdtrain/tasks``) assemble them into loaders."""

from .files.index import DamagedData, DataError

__all__ = ["DamagedData", "DataError"]
