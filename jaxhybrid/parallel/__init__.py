"""Parallelism applied from outside the single-device model: tensor (AxoNN 4D), pipeline (Myelin), the 2BP
split stage, and the data-parallel reductions."""
