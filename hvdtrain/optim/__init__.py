"""Optimizers and schedules: building them (build.py), LARS and LAMB (lars_lamb.py), the EMA."""
