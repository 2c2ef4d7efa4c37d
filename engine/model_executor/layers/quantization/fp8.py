"""FP8 (e4m3) weights and activations: W8A8, a weight scale per tensor.

vLLM twin: ``vllm/model_executor/layers/quantization/fp8.py`` (``Fp8Config``,
``Fp8LinearMethod``, ``Fp8OnlineLinearMethod``).
Read it for the three levels of base_config.py on a scheme whose kernel is
a matmul *in* fp8:

  Config  ``Fp8Config``: from ``quantization="fp8"`` on a float checkpoint
          (online: the weights are quantized as they load), or from a
          checkpoint's ``quantization_config`` (``quant_method: fp8``: the
          weights are stored in fp8 with a scale per tensor);
  Method  ``Fp8OnlineLinearMethod`` creates a float ``weight`` as usual and,
          once loaded, replaces it by ``weight_fp8 = weight / scale`` with
          ``scale = max|W| / 448``; ``Fp8LinearMethod`` creates the fp8
          ``weight`` and a ``weight_scale`` per checkpoint tensor, and after
          loading requantizes a fused layer's shards to their largest scale,
          so q, k and v share one;
  Kernel  ``apply_fp8_linear``: the input is quantized per call
          (input_quant_fp8.py: the checkpoint's ``input_scale``, or dynamic:
          a scale per token where vLLM's CUTLASS fp8 kernel would run -- CUDA,
          sm89 and newer, ``use_per_token_activations`` -- and one per tensor
          elsewhere, as vLLM chooses in ``Fp8LinearMethod.__init__``), then
          ``torch._scaled_mm(x_fp8, W_fp8.T, scale_x, scale_w)`` multiplies in
          fp8 and rescales into the activation dtype (tensor cores on Hopper;
          torch's own implementation on the CPU). Shapes ``_scaled_mm``
          refuses (dimensions not multiples of 16 on CUDA) take the reference
          path: dequantize both operands, multiply in float32.

Weights are stored transposed (``[in, out]``, a column-major view of the
``[out, in]`` tensor), the layout ``_scaled_mm`` wants for its second operand.
Sessions: 06 (quantization).

Simpler than vLLM: per-tensor weight scales only (no block quantization), no
DeepGEMM, CUTLASS or Marlin kernels (cuBLAS through ``torch._scaled_mm``), no
fp8 KV cache, no MoE; the activation dtype may also be float32 (the CPU runs
fp32).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import Parameter

from engine.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from engine.model_executor.layers.quantization.input_quant_fp8 import (
    FP8_DTYPE,
    QuantFP8,
    scaled_fp8_quant,
)
from engine.model_executor.layers.quantization.utils.quant_utils import GroupShape

ACTIVATION_SCHEMES = ["static", "dynamic"]
_SHARD_INDEX = {"q": 0, "k": 1, "v": 2}


class Fp8Config(QuantizationConfig):
    def __init__(
        self,
        is_checkpoint_fp8_serialized: bool = False,
        activation_scheme: str = "dynamic",
        ignored_layers: list[str] | None = None,
        weight_block_size: list[int] | None = None,
    ) -> None:
        if activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"fp8 activation_scheme must be one of {ACTIVATION_SCHEMES}, "
                f"got {activation_scheme!r}"
            )
        if weight_block_size is not None:
            raise ValueError(
                f"fp8 weight_block_size={weight_block_size}: block-wise FP8 checkpoints are not "
                "supported by Glassbox (per-tensor scales only)"
            )
        if activation_scheme == "static" and not is_checkpoint_fp8_serialized:
            raise ValueError("fp8 activation_scheme 'static' needs an fp8 checkpoint's input_scale")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])

    def __repr__(self) -> str:
        return (
            f"Fp8Config(serialized={self.is_checkpoint_fp8_serialized}, "
            f"activation_scheme={self.activation_scheme!r}, ignored_layers={self.ignored_layers})"
        )

    def get_name(self) -> str:
        return "fp8"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        quant_method = str(config.get("quant_method", ""))
        return cls(
            is_checkpoint_fp8_serialized="fp8" in quant_method,
            activation_scheme=config.get("activation_scheme", "dynamic"),
            ignored_layers=config.get("ignored_layers") or config.get("modules_to_not_convert"),
            weight_block_size=config.get("weight_block_size"),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from engine.model_executor.layers.linear import LinearBase

        if not isinstance(layer, LinearBase):
            return None
        if any(prefix == m or prefix.endswith("." + m) for m in self.ignored_layers):
            return None
        if self.is_checkpoint_fp8_serialized:
            return Fp8LinearMethod(self)
        return Fp8OnlineLinearMethod(self)


def scaled_mm_fits(weight_t: torch.Tensor, per_token: bool = False) -> bool:
    """Whether ``torch._scaled_mm`` takes this ``[in, out]`` weight (CUDA: sm89+,
    both dimensions multiples of 16; any row count of the input goes; CPU: per
    tensor scales -- torch's CPU kernel takes per-token ones only from 2.13 on).
    Decided once per layer after loading, not per call."""
    if weight_t.device.type == "cpu":
        return not per_token
    if weight_t.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(weight_t.device) < (8, 9):
        return False
    return weight_t.shape[0] % 16 == 0 and weight_t.shape[1] % 16 == 0


def use_per_token_activations(device: torch.device, act_dtype: torch.dtype) -> bool:
    """vLLM's rule for dynamic activation scales: per token where its CUTLASS
    fp8 kernel runs (``cutlass_fp8_supported``: CUDA, sm89+), per tensor
    elsewhere. cuBLAS's row-wise ``_scaled_mm`` gives a float32 output only
    from sm90 on, so float32 activations on sm89 stay per tensor."""
    if device.type != "cuda":
        return False
    capability = torch.cuda.get_device_capability(device)
    return capability >= (9, 0) or (capability >= (8, 9) and act_dtype != torch.float32)


def column_scales(weight_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """The per-tensor ``weight_scale`` repeated per output column, ``[1, out]``:
    cuBLAS's row-wise ``_scaled_mm`` pairs a ``[T, 1]`` token scale with it."""
    return weight_scale.float().reshape(1, 1).expand(1, out_features).contiguous()


def apply_fp8_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    quant: QuantFP8,
    use_scaled_mm: bool | None = None,
    weight_scale_columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., in] @ W.T + b`` with ``W = weight_t.T * weight_scale`` (fp8).
    ``use_scaled_mm``: the layer's ``scaled_mm_fits`` (None: decided here);
    ``weight_scale_columns``: the layer's ``column_scales`` (None: made here)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [T, in]
    q, scale = quant(x2, input_scale)  # scale: [] per tensor, [T, 1] per token
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_fits(weight_t, per_token=scale.dim() == 2)
    if use_scaled_mm:
        scale_b = weight_scale
        if scale.dim() == 2:
            scale_b = weight_scale_columns
            if scale_b is None:
                scale_b = column_scales(weight_scale, weight_t.shape[1])
        out = torch._scaled_mm(q, weight_t, scale_a=scale, scale_b=scale_b, out_dtype=x.dtype)
    else:  # the reference: both operands back in float32
        out = ((q.float() * scale) @ (weight_t.float() * weight_scale)).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight_t.shape[1])


class Fp8OnlineLinearMethod(QuantizeMethodBase):
    """A float checkpoint, quantized to fp8 per tensor once it is loaded."""

    def __init__(self, quant_config: Fp8Config) -> None:
        self.quant_config = quant_config
        # The input's quantizer; a dynamic one is settled per device once the
        # weights are loaded (select_activation_quant).
        self.quant = QuantFP8(static=False)

    def select_activation_quant(self, layer: nn.Module, act_dtype: torch.dtype) -> None:
        """Per-token dynamic scales on the devices vLLM uses them on; the
        weight scale repeated per column for ``_scaled_mm`` then; whether
        ``_scaled_mm`` takes the layer (``use_scaled_mm``)."""
        per_token = not self.quant.static and use_per_token_activations(
            layer.weight.device, act_dtype
        )
        if per_token:
            self.quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN)
        layer.use_scaled_mm = scaled_mm_fits(layer.weight, per_token)
        layer.weight_scale_columns = (
            column_scales(layer.weight_scale.data, layer.weight.shape[1]) if per_token else None
        )

    def create_weights(self, layer: nn.Module, *weight_args: Any, **weight_attrs: Any) -> None:
        """A float ``weight`` exactly as an unquantized layer has (``[out, in]``)."""
        from engine.model_executor.layers.linear import UnquantizedLinearMethod

        UnquantizedLinearMethod().create_weights(layer, *weight_args, **weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        act_dtype = layer.weight.dtype
        qweight, scale = scaled_fp8_quant(layer.weight.data)
        layer.weight = Parameter(qweight.t(), requires_grad=False)  # [in, out], column-major
        layer.weight_scale = Parameter(scale, requires_grad=False)
        layer.input_scale = None
        self.select_activation_quant(layer, act_dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return apply_fp8_linear(
            x,
            layer.weight,
            layer.weight_scale,
            layer.input_scale,
            bias,
            self.quant,
            layer.use_scaled_mm,
            layer.weight_scale_columns,
        )


def _load_shard_scale(param: Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A scale per checkpoint tensor: q/k/v (or gate/up) land at their index."""
    index = 0 if shard_id is None else _SHARD_INDEX.get(shard_id, shard_id)
    if loaded.numel() != 1:
        raise ValueError(
            f"fp8 scales must be per tensor (one number), got shape {tuple(loaded.shape)}"
        )
    param.data[index] = loaded.reshape(()).float()
    param.loaded_shards.add(index)


class Fp8LinearMethod(Fp8OnlineLinearMethod):
    """An fp8 checkpoint: ``weight`` in e4m3, ``weight_scale`` (and, for the
    static scheme, ``input_scale``) per checkpoint tensor."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            FP8_DTYPE,
            **extra_weight_attrs,
        )
        layer.logical_widths = list(output_partition_sizes)
        layer.orig_dtype = params_dtype  # the activations' dtype
        names = ["weight_scale"]
        if self.quant_config.activation_scheme == "static":
            names.append("input_scale")
            self.quant = QuantFP8(static=True)
        for name in names:
            scale = Parameter(
                torch.full((len(output_partition_sizes),), float("nan")), requires_grad=False
            )
            scale.weight_loader = _load_shard_scale
            scale.loaded_shards = set()
            layer.register_parameter(name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scales = layer.weight_scale.data.float()  # one per shard
        max_scale = scales.max()
        weight = layer.weight.data  # [out, in] fp8, the shards' rows stacked
        if len(layer.logical_widths) > 1 and not bool((scales == max_scale).all()):
            # Requantize every shard to the largest scale: one scale per layer.
            parts, start = [], 0
            for width, scale in zip(layer.logical_widths, scales, strict=True):
                rows = weight[start : start + width].float() * scale
                parts.append(scaled_fp8_quant(rows, max_scale)[0])
                start += width
            weight = torch.cat(parts)
        layer.weight = Parameter(weight.t(), requires_grad=False)
        layer.weight_scale = Parameter(max_scale.reshape(()), requires_grad=False)
        input_scale = getattr(layer, "input_scale", None)
        if input_scale is not None:
            layer.input_scale = Parameter(input_scale.data.max().reshape(()), requires_grad=False)
        else:
            layer.input_scale = None
        self.select_activation_quant(layer, layer.orig_dtype)


__all__ = [
    "ACTIVATION_SCHEMES",
    "Fp8Config",
    "Fp8LinearMethod",
    "Fp8OnlineLinearMethod",
    "apply_fp8_linear",
    "column_scales",
    "use_per_token_activations",
]
