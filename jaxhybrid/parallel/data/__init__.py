"""Data parallelism: the gradient reductions over a stage's data replicas (Myelin Sec. IV-B, V-C)."""
