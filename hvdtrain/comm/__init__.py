"""The only door to Horovod's training side: collectives, the distributed optimizer, broadcasts
(dist.py), and what Horovod starts from (horovod_env.py, launcher_env.py, buckets.py)."""
