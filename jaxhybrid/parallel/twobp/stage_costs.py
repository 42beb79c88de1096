"""What XLA counts for a :class:`~jaxhybrid.parallel.twobp.stage.Stage`'s compiled kernels: flops and bytes.

2BP (Sec. 3) splits the backward without adding arithmetic: the input pass does the input-gradient
work and the weight pass only the ``dW = x^T dy`` matmuls (plus the batch sums of per-sample norm and
bias gradients). :func:`kernel_costs` reads that off the compiled programs themselves, free of timing
noise. On the CPU backend: ``backward_input + backward_weight`` flops match the fused
``backward``'s up to the cheap elementwise work XLA duplicates into several consumer fusions (the fused
pass duplicates more), and a weight pass that recomputed any of the forward would show up as extra flops.
The bytes are XLA's count at fusion boundaries (operands read plus results written, per fusion): equal
bytes with unequal times point at cache locality or scheduling, not at extra traffic.
On a GPU, XLA's count leaves out library calls (cuBLAS matmuls, cuDNN attention), and not evenly across
passes, so :func:`split_ratios` gives no ratio there.
"""
from __future__ import annotations

# Entry-computation instructions that launch no device work (buffer plumbing).
_NO_LAUNCH = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def entry_ops(hlo_text: str) -> int:
    """Instructions of the optimized program's ENTRY computation that do device work (fusions, library
    calls, copies, command buffers): about the launches each call makes, which a synchronous call
    cannot overlap with earlier work."""
    lines = hlo_text.split("\nENTRY ", 1)[-1].split("\n}", 1)[0].splitlines()[1:]
    count = 0
    for line in lines:
        rhs = line.split(" = ", 1)[-1].strip()
        if rhs.startswith("("):  # a tuple type: skip to its closing parenthesis
            depth = 0
            for i, ch in enumerate(rhs):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    rhs = rhs[i + 1:]
                    break
        else:
            rhs = rhs.split(" ", 1)[-1]
        count += rhs.strip().split("(", 1)[0] not in _NO_LAUNCH
    return count


def compiled_cost(jitted, *args) -> dict[str, float]:
    """``{"flops", "bytes_accessed", "entry_ops"}`` of ``jitted`` compiled for ``args``: XLA's
    HloCostAnalysis and :func:`entry_ops`."""
    compiled = jitted.lower(*args).compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca  # a list per program in older jax
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "entry_ops": entry_ops(compiled.as_text())}


def kernel_costs(stage, params, x, targets, res, dy, wr) -> dict[str, dict[str, float]]:
    """``{kernel: {"flops", "bytes_accessed"}}`` of the four compiled kernels for one microbatch: the
    programs the stage's public methods call (with no gradient sum ``acc``), lowered on the caller's own
    ``forward`` residuals ``res``, cotangent ``dy`` and ``backward_input`` weight residuals ``wr``, so
    nothing is run again. ``x`` and ``targets`` are normalised as ``forward`` does."""
    x, targets = stage.checks.inputs(params, x, targets)
    k = stage.kernels
    progs = {"forward": (k.forward_program, params, x, targets),
             "backward_input": (k.input_program, *k.input_args(res, dy)),
             "backward_weight": (k.weight_program, params, wr, None), "backward": (k.fused_program, res, dy, None)}
    return {k: compiled_cost(fn, *a) for k, (fn, *a) in progs.items()}


def split_ratios(costs: dict[str, dict[str, float]], platform: str = "cpu") -> dict[str, float | None]:
    """(input + weight) / fused for flops and for bytes: what the split costs by XLA's own count; None
    off the CPU, where that count misses library calls (module docstring)."""
    keys = {"split_flops_over_fused": "flops", "split_bytes_over_fused": "bytes_accessed"}
    if platform != "cpu":
        return dict.fromkeys(keys)

    def ratio(key):
        fused = costs["backward"][key]
        return (costs["backward_input"][key] + costs["backward_weight"][key]) / fused if fused else float("nan")

    return {name: ratio(key) for name, key in keys.items()}


__all__ = ["compiled_cost", "kernel_costs", "split_ratios"]
