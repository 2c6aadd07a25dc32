"""The recommendation task (task.py), its settings section (settings.py) and models."""
