"""WebDataset tar shards: the loader (loader.py) and the tar reader (tar.py)."""
