"""Other formats in and out: Hugging Face checkpoints."""
