"""verl 0.9.1's own CheckpointEngineManager driving p2psync's verl backend into real sglang servers (CPU)."""
