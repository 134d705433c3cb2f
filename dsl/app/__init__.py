"""What the commands share: a spec and flags -> a built run, golden runs, checkpoints."""
