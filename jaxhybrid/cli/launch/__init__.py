"""The launcher's helpers: checks made before mpiexec starts, and which failed rank to name."""
