"""Training: optimizer, schedules, precision, checkpoints, logging and the loop."""
