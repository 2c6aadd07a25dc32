"""Everything between ranks, behind one facade (dist.py): collectives, the distributed optimizer and
broadcasts on either engine, Horovod's (horovod_engine.py, with what it starts from: horovod_env.py,
launcher_env.py, buckets.py) or torch.distributed's (torch_engine.py, torch_optimizer.py). Only this
package imports Horovod's training side (tests/unit/test_layers.py)."""
