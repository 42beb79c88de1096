"""2BP (backward split into input- and weight-gradient passes): the pipeline stage and its kernels."""
