"""Checkpoints: atomic writes and safe reads (io.py), and whether one belongs to this run
(identity.py)."""
