"""What runs a job: the engines, the trainer, checkpoints, the run directory, metrics and data."""
