"""The run's metric record: ``metrics.jsonl``, TensorBoard scalars and the console line."""
