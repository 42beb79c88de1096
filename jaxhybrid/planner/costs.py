"""Per-layer costs of a chain (MadPipe Sec. 3 notation): u_F, u_B (= u_BI + u_BW), W_l, a_l.

Profiles are JSON ``{"input_bytes": a0, "layers": [{"name", "forward_s", "backward_s", "weight_bytes",
"activation_bytes"[, "backward_input_s", "backward_weight_s", "stored_bytes"]}, ...]}``: ``activation_bytes``
is a_l, the output of layer l (sent to the next stage, and its gradient b_l back), ``input_bytes`` is a_0.
``stored_bytes`` is what layer l keeps per microbatch from its forward to its backward; MadPipe's model
(Sec. 4.3, ā_s = sum of a_{i-1}) assumes a layer keeps only its input, a_{l-1}, the default. A transformer
block keeps tens of times its input (the stage kernels' residuals: 48x for GPT-2 small at 1024 tokens),
so the profiles :mod:`jaxhybrid.planner.profile` makes carry it. Profiles come from a cluster, another
framework, or the analytic builders here (flop counts over a hardware file's peak).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from jaxhybrid.core.config.parse import read_text
from jaxhybrid.core.hardware import HARDWARE_DIR
from jaxhybrid.core.hardware import load_hardware as load_checked
from jaxhybrid.planner.hardware_checks import planner_key_errors

_REQUIRED = ("name", "forward_s", "backward_s", "weight_bytes", "activation_bytes")
_OPTIONAL = ("backward_input_s", "backward_weight_s", "stored_bytes")


@dataclass(frozen=True)
class LayerCost:
    name: str
    forward_s: float
    backward_s: float  # fused backward (input + weight gradients)
    weight_bytes: float
    activation_bytes: float  # a_l: the layer's output
    backward_input_s: float | None = None  # 2BP split, when known
    backward_weight_s: float | None = None
    stored_bytes: float | None = None  # kept from forward to backward; None: a_{l-1} (MadPipe's count)


@dataclass(frozen=True)
class Profile:
    input_bytes: float  # a_0
    layers: tuple[LayerCost, ...]

    def to_json(self) -> dict:
        layers = [{k: v for k, v in asdict(lc).items() if v is not None} for lc in self.layers]
        return {"input_bytes": self.input_bytes, "layers": layers}


def _number(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"profile {where}={v!r} must be a finite number")
    if v < 0:
        raise ValueError(f"profile {where}={v!r} is negative; times and bytes must be >= 0")
    return float(v)


def profile_from_json(data: dict) -> Profile:
    """Validate and build a :class:`Profile`; a bad field raises ValueError naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"profile must be a JSON object with input_bytes and layers, got {type(data).__name__}")
    if "input_bytes" not in data:
        raise ValueError("profile is missing 'input_bytes' (a_0, bytes of the network input)")
    if not isinstance(data.get("layers"), list) or not data["layers"]:
        raise ValueError("profile 'layers' must be a non-empty list of layer objects")
    layers = []
    for i, d in enumerate(data["layers"]):
        if not isinstance(d, dict):
            raise ValueError(f"profile layers[{i}] must be an object")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"profile layers[{i}] is missing {', '.join(missing)}")
        unknown = set(d) - set(_REQUIRED) - set(_OPTIONAL)
        if unknown:
            raise ValueError(f"profile layers[{i}] has unknown keys {sorted(unknown)}")
        kw = {k: _number(d[k], f"layers[{i}].{k}") for k in _REQUIRED[1:]}
        for k in _OPTIONAL:
            if k in d:
                kw[k] = _number(d[k], f"layers[{i}].{k}")
        if ("backward_input_s" in kw) != ("backward_weight_s" in kw):
            raise ValueError(f"profile layers[{i}] gives only one of backward_input_s / backward_weight_s")
        layers.append(LayerCost(str(d["name"]), **kw))
    return Profile(_number(data["input_bytes"], "input_bytes"), tuple(layers))


def read_json(path: str | Path, what: str):
    """Parse a JSON file; a missing file or bad JSON raises an error naming ``what`` and the path."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")

    text = read_text(p, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {p} is not valid JSON: {e}") from None


def load_profile(path: str | Path) -> Profile:
    return profile_from_json(read_json(path, "profile"))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1))


def _has_bandwidths(hw) -> bool:
    bw = hw.get("bandwidth") if isinstance(hw, dict) else None
    return isinstance(bw, dict) and "intra_node" in bw and "inter_node" in bw


def planner_hardware_names() -> list[str]:
    """The ``configs/hardware`` files the planner can use: those with the bandwidths of AxoNN's model
    (Sec. V). Others (``cpu.yaml``) only serve the MFU bookkeeping of training runs."""
    import yaml

    names = []
    for p in sorted(HARDWARE_DIR.glob("*.yaml")):
        try:
            if _has_bandwidths(yaml.safe_load(p.read_text())):
                names.append(p.stem)
        except yaml.YAMLError:
            pass  # reported when it is asked for by name
    return names


def load_hardware(name_or_path: str) -> dict:
    """A ``configs/hardware`` file by name (``perlmutter``) or path: :func:`jaxhybrid.model.flops.load_hardware`
    plus the keys the planner needs; errors list only the files the planner can use."""

    usable = f"the planner can use {', '.join(planner_hardware_names()) or 'none'}, or a path to such a YAML file"
    try:
        hw = load_checked(name_or_path)
    except FileNotFoundError:
        raise FileNotFoundError(f"hardware {name_or_path!r} not found in {HARDWARE_DIR}; {usable}") from None
    if not _has_bandwidths(hw):
        raise ValueError(f"hardware {name_or_path!r} has no bandwidth.intra_node / bandwidth.inter_node keys, so "
                         f"it serves MFU bookkeeping in training runs but not the planner; {usable}")

    errors = planner_key_errors(hw)
    if errors:
        raise ValueError(f"hardware file {name_or_path}: {'; '.join(errors)}")
    return hw


# --- analytic chains (flops / (peak * efficiency)) -------------------------------------------------------


def _layer(name, flops, weights, out_elems, flops_per_s, dtype_bytes) -> LayerCost:
    """Backward = 2x forward flops, split evenly into input and weight gradients (weight-free: all input)."""
    fwd = flops / flops_per_s
    bwi = fwd if weights else 2 * fwd
    bww = fwd if weights else 0.0
    return LayerCost(name, fwd, bwi + bww, weights * dtype_bytes, out_elems * dtype_bytes, bwi, bww)


def resnet50_chain(image: int = 1000, batch: int = 8, flops_per_s: float = 15.7e12 * 0.5,
                   dtype_bytes: int = 4) -> Profile:
    """A ResNet-50-like chain (MadPipe Sec. 5: images 1000 x 1000, batch 8), one layer per convolution.

    Bottleneck blocks are linearised as their three convolutions (the residual add joins the third);
    batch norm and ReLU fold into the convolution before them. Costs are flop counts on a V100-like device.
    """
    layers, h, c = [], image, 3

    def conv(name, cin, cout, k, stride, hin, pool=1):
        hout = math.ceil(hin / stride)
        flops = 2 * batch * hout * hout * cin * cout * k * k
        hout = math.ceil(hout / pool)  # a following max pool shrinks what is stored and sent
        layers.append(_layer(name, flops, cin * cout * k * k + 2 * cout, batch * hout * hout * cout,
                             flops_per_s, dtype_bytes))
        return hout

    h = conv("conv1", c, 64, 7, 2, h, pool=2)
    c = 64
    for stage, (width, blocks, stride) in enumerate(((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))):
        for b in range(blocks):
            s = stride if b == 0 else 1
            tag = f"res{stage + 2}.{b}"
            conv(tag + ".a", c, width, 1, 1, h)
            h = conv(tag + ".b", width, width, 3, s, h)
            conv(tag + ".c", width, 4 * width, 1, 1, h)
            c = 4 * width
    layers.append(_layer("fc", 2 * batch * c * 1000, c * 1000 + 1000, batch * 1000, flops_per_s, dtype_bytes))
    return Profile(batch * image * image * 3 * dtype_bytes, tuple(layers))


def transformer_chain(n_layers: int = 16, d_model: int = 2048, seq: int = 1024, batch: int = 8,
                      vocab: int = 50257, flops_per_s: float = 15.7e12 * 0.5, dtype_bytes: int = 4) -> Profile:
    """A GPT-like chain at sub-block granularity: per block an attention layer and an MLP layer.

    Each layer's a_l is the hidden state it outputs (what crosses a stage boundary). MadPipe's model
    stores one input tensor per layer and batch, so the layers' internal activations (attention scores,
    the 4d MLP hidden) are not counted: this chain is light on activations and heavy on weights.
    """
    t = batch * seq
    d = d_model
    layers = [_layer("embed", 0.0, vocab * d, t * d, flops_per_s, dtype_bytes)]
    for i in range(n_layers):
        attn_flops = 2 * t * d * 4 * d + 4 * batch * seq * seq * d
        layers.append(_layer(f"block{i}.attn", attn_flops, 4 * d * d, t * d, flops_per_s, dtype_bytes))
        layers.append(_layer(f"block{i}.mlp", 2 * t * d * 8 * d, 8 * d * d, t * d, flops_per_s, dtype_bytes))
    layers.append(_layer("head", 2 * t * d * vocab, 0, t, flops_per_s, dtype_bytes))
    return Profile(t * 4, tuple(layers))
