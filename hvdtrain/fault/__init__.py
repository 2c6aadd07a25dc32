"""What goes wrong around a step and what the run does then: the watchdog, preemption and
spot notices, elastic membership, the cross-rank audit, data that vanishes."""
