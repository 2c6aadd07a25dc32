"""What a run says about itself: metrics and their writers, step phases, host statistics, the
epoch report, rank logs, and the trackers (W&B, MLflow)."""
