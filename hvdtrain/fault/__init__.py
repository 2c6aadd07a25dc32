"""What goes wrong around a step and how it is noticed: the watchdog, stop signals, preemption and
spot notices, the attempts of a run, the cross-rank audit. Below the training loop: nothing here
imports hvdtrain/train/ (tests/unit/test_layers.py). What a run does about elastic membership and
vanished data acts on the run itself, and lives with it (train/elastic.py, train/bad_data.py)."""
