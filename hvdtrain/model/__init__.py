"""Models: by name (build.py), pretrained weights and freezing (finetune.py), SyncBatchNorm (sync_bn.py)."""
