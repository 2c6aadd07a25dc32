"""The training loop: the Trainer (trainer.py), a step and an epoch (engine.py), building and resuming
a run (run.py, builders.py, resume.py), its state (state.py), its checkpoints (save.py), the end of
an epoch (outputs.py), early stops (stops.py), elastic membership (elastic.py), data that vanishes
(bad_data.py), what it may find on a loader (capabilities.py), its folder (run_folder.py) and the
checks made before any rank starts (preflight.py)."""
