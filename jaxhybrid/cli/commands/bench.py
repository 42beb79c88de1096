"""``jaxhybrid bench NAME ...``: dispatch to ``jaxhybrid.bench.NAME`` (``add_arguments`` / ``run``)."""
from __future__ import annotations

import argparse
import importlib

from jaxhybrid.core.argtypes import DefaultsHelp

BENCHES = {
    "step": "trainer step vs a plain jit(value_and_grad) + optax step",
    "stage": "2BP stage kernels: forward, fused backward, input and weight gradients",
    "pipeline": "pipeline throughput with and without 2BP, or with several stages per rank against 1F1B, under mpirun",
    "offload": "host-offloaded optimizer: device bytes, step time, all-reduce overlap sweep",
    "allreduce": "data-parallel gradient all-reduce over MPI ranks: mpi4jax (mpi) vs XLA collectives (xla), under mpirun",
    "tensor": "AxoNN 3D tensor parallelism: per-factorization step time and collective bytes",
    "partition": "MadPipe vs PipeDream + 1F1B* periods on layer chains",
    "curve": "the planner's compute curve: stage passes' time against microbatch size, fitted for a hardware file",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    p.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")


def prepare(args: argparse.Namespace) -> None:
    """Parse the benchmark's own arguments and let it settle its environment (``prepare(ns)``, e.g. its
    fake CPU devices) before JAX starts."""
    module = importlib.import_module(f"jaxhybrid.bench.{args.name.replace('-', '_')}")

    p = argparse.ArgumentParser(prog=f"jaxhybrid bench {args.name}", description=BENCHES[args.name],
                                formatter_class=DefaultsHelp)
    module.add_arguments(p)
    args.bench_module, args.bench_args = module, p.parse_args(args.rest)
    getattr(module, "prepare", lambda _: None)(args.bench_args)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_module.run(args.bench_args) or 0)
