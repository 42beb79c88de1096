"""Throughput metrics: model and hardware flops, MFU/HFU, Myelin's time to train, and the hardware files.

Flops are counted from the model's own matmul shapes (:func:`jaxhybrid.core.config.model.block_matmuls`:
``d_ff``, LLaMA's SwiGLU and grouped-query k/v widths included), for a batch of ``b`` sequences of ``s``
tokens (``T = b s``), width ``d``, vocabulary ``V`` and ``l`` blocks:

* forward of one block: ``2 T sum(k n)`` over its matmuls ``(k, n)`` plus the attention core (``Q K^T``
  and ``A V``) ``4 b s^2 d``, counted without the causal mask's saving (as Narayanan et al. and the
  stage benchmark do); the head's logits: ``2 T d V``;
* model flops per step (``tflops_per_device``, ``mfu``): forward + backward, ``3 x`` the forward, with no
  recomputation, the PaLM / MaxText definition of MFU. For GPT-2 shapes (``d_ff = 4d``, full multi-head
  attention) this is exactly Narayanan et al.'s ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``;
* hardware flops per step (``hw_tflops_per_device``, ``hfu``): the model flops plus what ``train.remat``
  recomputes: ``none`` nothing, ``dots`` the attention core's forward (``4 b s^2 d`` per block; the
  matmul outputs are saved), ``full`` one more forward of the blocks (not the head; for GPT-2 shapes
  Narayanan's ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``). Kernels' own recomputation (a flash
  attention backward recomputing its scores) is not counted;
* estimated time to train on 300 B tokens: ``3e11 * t / (B s)`` (Myelin Sec. VI-D), ``t`` the step time;
* MFU and HFU: achieved model (hardware) flop/s per device over the hardware file's peak for the compute
  dtype; with ``remat: none`` they are equal.
* Myelin's flop/s (Sec. VI-D) is Narayanan's ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` over the batch
  time: the flops of a step that recomputes the blocks' forward. For GPT-2 shapes that is the hardware
  count of ``remat: full``, so Myelin's flop/s is ``hw_tflops_per_device`` times the devices of a
  ``remat: full`` run and its percentage of peak that run's ``hfu``. With ``none`` or ``dots`` the
  96-form counts a recomputation the run does not do; ``tflops_per_device`` / ``mfu`` are the 72-form.
* The run summary (:func:`steady_state`) gives the same columns from the mean time of the steps after the
  first, as Myelin averages the last 10 of 11 batches.

The run's record of them is :class:`jaxhybrid.runtime.metrics.writer.MetricsWriter`.
"""
from __future__ import annotations

from typing import Any

from jaxhybrid.core.config.model import REMATS, block_matmuls

GPT3_TOKENS = 300e9  # Myelin Sec. VI-D: the GPT-3 training regime, 300 billion tokens


def _check(batch: int, seq: int) -> None:
    for name, v in (("batch", batch), ("seq", seq)):
        if v < 1:
            raise ValueError(f"flops: {name}={v} must be >= 1")


def attention_core_flops(model, batch: int, seq: int) -> float:
    """Forward flops of one block's attention core, ``Q K^T`` and ``A V``: ``4 b s^2 d`` (every head's
    query width sums to ``d`` whatever the k/v heads; the causal mask's zeros are counted)."""
    _check(batch, seq)
    return 4.0 * batch * seq * seq * model.d_model


def forward_flops(model, batch: int, seq: int, blocks: int | None = None, head: bool = True) -> float:
    """Forward flops of ``blocks`` transformer blocks of ``model`` (a :class:`~jaxhybrid.model.ModelConfig`;
    default all ``n_layers``), plus the head's logits matmul with ``head``, on ``batch`` sequences of
    ``seq`` tokens: ``blocks (2 T sum(k n) + 4 b s^2 d) + 2 T d V``. A pipeline stage's count is
    ``forward_flops(model, microbatch, seq, its_blocks, head=is_last)``."""

    _check(batch, seq)
    blocks = model.n_layers if blocks is None else blocks
    tokens = float(batch) * seq
    per_block = 2.0 * tokens * sum(k * n for k, n, _ in block_matmuls(model)) + attention_core_flops(model, batch, seq)
    return blocks * per_block + (2.0 * tokens * model.d_model * model.vocab_size if head else 0.0)


def model_flops_per_step(model, batch: int, seq: int) -> float:
    """Model flops of one training step of ``batch`` sequences: forward + backward (``3 x`` forward), no
    recomputation. What ``tflops_per_device`` and ``mfu`` count."""
    return 3.0 * forward_flops(model, batch, seq)


def recompute_flops_per_step(model, batch: int, seq: int, remat: str) -> float:
    """Flops that ``train.remat`` adds to a step by recomputing forward work in the backward: ``none`` 0,
    ``dots`` the attention cores (``l x 4 b s^2 d``), ``full`` the blocks' forward (not the head)."""
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMATS)}")
    if remat == "none":
        _check(batch, seq)
        return 0.0
    if remat == "dots":
        return model.n_layers * attention_core_flops(model, batch, seq)
    return forward_flops(model, batch, seq, head=False)


def hardware_flops_per_step(model, batch: int, seq: int, remat: str) -> float:
    """Flops one training step executes: the model flops plus ``remat``'s recomputation. What
    ``hw_tflops_per_device`` and ``hfu`` count."""
    return model_flops_per_step(model, batch, seq) + recompute_flops_per_step(model, batch, seq, remat)


def tokens_per_s(batch: int, seq: int, step_time_s: float) -> float:
    return batch * seq / step_time_s


def tflops_per_device(flops: float, step_time_s: float, n_devices: int = 1) -> float:
    """Achieved TFLOP/s per device for a step of ``flops`` spread over ``n_devices``."""
    return flops / step_time_s / max(1, n_devices) / 1e12


def mfu(flops: float, step_time_s: float, n_devices: int, peak_tflops: float) -> float:
    """Model flops utilisation in [0, 1]: achieved per-device flop/s over the device's peak."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops={peak_tflops} must be > 0")
    return tflops_per_device(flops, step_time_s, n_devices) / peak_tflops


def step_flop_rates(model_flops: float, hardware_flops: float, step_time_s: float, n_devices: int,
                    peak_flops: float | None) -> dict[str, float | None]:
    """A step's flop columns (``metrics.jsonl``, TensorBoard ``train/...``): ``tflops_per_device`` and
    ``mfu`` from the model flops, ``hw_tflops_per_device`` and ``hfu`` from the hardware flops, per
    device over ``n_devices``; ``mfu`` and ``hfu`` are None when there is no ``peak_flops`` (flop/s per
    device) for the run's device."""
    model = tflops_per_device(model_flops, step_time_s, n_devices)
    hw = tflops_per_device(hardware_flops, step_time_s, n_devices)
    ratio = (lambda t: t * 1e12 / peak_flops) if peak_flops else (lambda t: None)
    return {"tflops_per_device": model, "mfu": ratio(model), "hw_tflops_per_device": hw, "hfu": ratio(hw)}


def time_to_train_s(step_time_s: float, batch: int, seq: int, tokens: float = GPT3_TOKENS) -> float:
    """Myelin Sec. VI-D: estimated training time ``3e11 * t / (b s)`` on ``tokens`` tokens, in seconds."""
    return tokens * step_time_s / (batch * seq)


def steady_state(step_times: list[float], model_flops: float, hardware_flops: float, batch: int, seq: int,
                 n_devices: int, peak_flops: float | None) -> dict[str, Any]:
    """The run summary's throughput, Myelin Sec. VI-D's way: from the mean step time ``t`` of the steps after
    the first (Myelin times 11 batches and averages the last 10; our first step also compiles), or of the only
    step when one ran. ``steady_steps`` says how many were averaged; ``mean_step_time_s`` is ``t``,
    ``time_to_train_s`` is :func:`time_to_train_s` of ``t``, and the flop columns are
    :func:`step_flop_rates` of ``t``: the per-step columns with the mean time (achieved flop/s over the
    window, not a mean of per-step rates). All None when no step ran."""
    steady = list(step_times[1:] or step_times)
    keys = ("mean_step_time_s", "time_to_train_s", "tokens_per_s", "tflops_per_device", "mfu",
            "hw_tflops_per_device", "hfu")
    if not steady:
        return {"steady_steps": 0, **dict.fromkeys(keys)}
    t = sum(steady) / len(steady)
    return {"steady_steps": len(steady), "mean_step_time_s": t, "time_to_train_s": time_to_train_s(t, batch, seq),
            "tokens_per_s": tokens_per_s(batch, seq, t),
            **step_flop_rates(model_flops, hardware_flops, t, n_devices, peak_flops)}


