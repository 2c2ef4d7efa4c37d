"""Linear layers with tensor-parallel seams and fused-weight loading.

vLLM twin: ``vllm/model_executor/layers/linear.py``.
Read it for two ideas:
  * one parameter can hold several checkpoint tensors: ``QKVParallelLinear``
    stacks q/k/v rows, ``MergedColumnParallelLinear`` stacks gate/up rows, and
    ``weight_loader(param, loaded_weight, loaded_shard_id)`` copies each
    checkpoint tensor into its row range (``output_sizes`` -> shard offsets);
  * where tensor parallelism would cut a matrix: column-parallel layers split
    the output rows of ``W`` (each rank computes part of ``y``), row-parallel
    layers split the input columns (each rank computes a partial ``y`` that an
    all-reduce sums).
Weights follow ``torch.nn.functional.linear``: ``W`` is ``[out, in]`` and
``y = x @ W.T + b``. ``forward`` returns ``(output, output_bias)`` as in vLLM
(``output_bias`` is only non-None with ``skip_bias_add``).
Sessions: 04 (worker: model loading).

On CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` also keeps
a copy of ``W`` prepacked by oneDNN (``dispatch_cpu_unquantized_gemm``, as in
vLLM): decode-sized batches (4 to 256 rows) multiply against it, other calls
keep using ``F.linear``. Read it for why a CPU engine repacks weights once at
load (a decode step is a few dozen rows against every weight of the model).

``quant_config`` (a ``QuantizationConfig``, layers/quantization/) picks the
layer's quant method: the one that creates its parameters and computes its
output; without one it is ``UnquantizedLinearMethod``. The weight loaders
hand a GGUF layer's tensors over whole (``_maybe_load_gguf``): its method
stacks them once the file is read (session 06).

Under tensor parallelism (session 07) each rank builds the same layers with
``tp_rank`` / ``tp_size`` from ``get_tp_group()`` and ends up holding its
slice: the weight loaders narrow every checkpoint tensor to that slice before
copying it (the full tensor is never copied to the device), a column-parallel
layer's output stays split (``gather_output`` all-gathers it), and a
row-parallel layer's partial products are summed by one all-reduce
(``reduce_results``).

Simpler than vLLM: no pipeline parallelism, no sequence-parallel
reduce-scatter, and a GGUF layer is never split (GGUF runs with one rank).
vLLM keeps the CPU GEMM dispatch in ``layers/utils.py`` and drops the unpacked
``W``; ours lives here and keeps ``W`` (prefill-sized calls and the weight
loaders still read it), so the CPU holds the linear weights twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from engine.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

if TYPE_CHECKING:
    from engine.model_executor.layers.quantization import QuantizationConfig


def set_weight_attrs(weight: torch.Tensor, weight_attrs: dict[str, Any] | None) -> None:
    """Attach loading hints to a parameter (``output_dim``, ``weight_loader``...).

    vLLM keeps this helper in ``vllm/model_executor/utils.py``.
    """
    for key, value in (weight_attrs or {}).items():
        if hasattr(weight, key):
            raise AttributeError(f"overwriting existing tensor attribute {key!r}")
        setattr(weight, key, value)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def _rank_slice(
    loaded: torch.Tensor, dim: int | None, shard_size: int, shard_rank: int, full_size: int
) -> torch.Tensor:
    """This rank's ``shard_size`` entries of a full checkpoint tensor along ``dim``.

    A tensor whose size along ``dim`` is not ``full_size`` is returned as is,
    so the copy that follows reports the mismatch instead of hiding it.
    """
    if dim is None or loaded.ndim <= dim or loaded.shape[dim] != full_size:
        return loaded
    return loaded.narrow(dim, shard_rank * shard_size, shard_size)


def _copy_checked(prefix: str, what: str, param_data: torch.Tensor, loaded: torch.Tensor) -> None:
    if param_data.shape != loaded.shape:
        raise ValueError(
            f"{prefix or 'linear layer'}: {what} expects shape {tuple(param_data.shape)}, "
            f"the checkpoint tensor has shape {tuple(loaded.shape)}"
        )
    param_data.copy_(loaded)


def _maybe_load_gguf(param: Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> bool:
    """A GGUF layer's ``qweight`` / ``qweight_type`` keep each shard's tensor
    as it comes (its row width depends on the format); True when handled."""
    if getattr(param, "is_gguf_weight_type", False):
        param.shard_weight_type[shard_id] = int(loaded_weight.item())
        return True
    if getattr(param, "is_gguf_weight", False):
        param.data_container[shard_id] = loaded_weight
        return True
    return False


def _check_fused_size(prefix: str, loaded: torch.Tensor, dim: int, output_sizes: list[int]) -> None:
    if loaded.ndim <= dim or loaded.shape[dim] != sum(output_sizes):
        raise ValueError(
            f"{prefix or 'linear layer'}: a fused checkpoint tensor must have "
            f"{sum(output_sizes)} (= {' + '.join(map(str, output_sizes))}) entries along dim "
            f"{dim}, got shape {tuple(loaded.shape)}"
        )


logger = logging.getLogger(__name__)

# oneDNN lays the packed weight out for batches of about this many rows (its
# "batch hint"): a typical decode batch; the hint barely changes the speed.
CPU_PACKED_GEMM_BATCH_HINT = 32
# Calls with this many rows (inclusive range) use the packed weight: there it
# beats F.linear (MKL sgemm). For one or two rows MKL's matrix-vector path wins;
# from a few hundred rows the two are on par.
CPU_PACKED_GEMM_MIN_ROWS = 4
CPU_PACKED_GEMM_MAX_ROWS = 256


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def dispatch_cpu_unquantized_gemm(layer: nn.Module) -> None:
    """Decide once, after loading, how ``layer``'s ``x W^T + b`` runs on CPU.

    Sets ``layer.cpu_packed_weight``: ``W`` reordered into oneDNN's blocked
    layout for the matmul kernel (an opaque tensor that only
    ``torch.ops.mkldnn._linear_pointwise`` reads), or None when the layer is
    not a float32 CPU matrix or oneDNN is unavailable. Packing at load time
    saves the per-call repack a plain GEMM does for small row counts; the
    decode steps of a CPU engine are exactly those calls.
    A packed copy goes stale if ``W`` is overwritten later: call this again.
    """
    layer.cpu_packed_weight = None
    weight = getattr(layer, "weight", None)
    if (
        weight is None
        or weight.device.type != "cpu"
        or weight.dtype != torch.float32
        or weight.ndim != 2
        or not _onednn_linear_available()
    ):
        return
    try:
        layer.cpu_packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), CPU_PACKED_GEMM_BATCH_HINT
        )
    except RuntimeError as e:  # an unusual build: fall back to F.linear
        logger.warning("oneDNN weight prepacking failed, using F.linear: %s", e)


def cpu_unquantized_gemm(
    layer: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x W^T + b``, through the prepacked weight when ``x`` has decode-sized rows."""
    packed = getattr(layer, "cpu_packed_weight", None)
    # In a compiled graph the row count is symbolic and the GEMM is Inductor's choice.
    if packed is not None and x.is_cpu and not torch.compiler.is_compiling():
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if CPU_PACKED_GEMM_MIN_ROWS <= rows <= CPU_PACKED_GEMM_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class UnquantizedLinearMethod:
    """Creates a plain ``[out, in]`` weight and applies ``y = x W^T + b``."""

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
        weight = Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        # dim 0 of W indexes outputs, dim 1 inputs: the loaders slice by these.
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once the checkpoint is in ``layer.weight`` (on every device)."""
        if layer.weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight.is_cpu:
            return cpu_unquantized_gemm(layer, x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """Fields every linear layer shares; subclasses create the parameters."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix  # full module name, used in error messages
        self.quant_config = quant_config
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.return_bias = return_bias
        self.disable_tp = disable_tp
        # This rank's place in the tensor-parallel group (0 of 1 without TP).
        self.tp_rank = 0 if disable_tp else get_tensor_model_parallel_rank()
        self.tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()

    def _make_bias(self, size: int, attrs: dict[str, Any]) -> None:
        if self.has_bias:
            self.bias = Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, attrs)
        else:
            self.register_parameter("bias", None)

    def _finish(self, output: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Parameter | None]:
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole matrix (used for small, unsharded projections)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            input_size,
            output_size,
            bias,
            skip_bias_add,
            params_dtype,
            prefix,
            return_bias=return_bias,
            disable_tp=disable_tp,
            quant_config=quant_config,
        )
        self.output_partition_sizes = list(getattr(self, "output_sizes", [output_size]))
        self.quant_method.create_weights(
            self,
            self.input_size,
            self.output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        self._make_bias(self.output_size, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        if _maybe_load_gguf(param, loaded_weight):
            return
        _copy_checked(self.prefix, "parameter", param.data, loaded_weight)

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        return self._finish(self.quant_method.apply(self, x, bias))


class ColumnParallelLinear(LinearBase):
    """``y = x W^T + b`` with ``W``'s output rows split across ranks.

    Rank r holds rows ``[r * out/tp, (r+1) * out/tp)`` and produces that slice
    of ``y``; ``gather_output`` would all-gather the slices.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        output_sizes: list[int] | None = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            input_size,
            output_size,
            bias,
            skip_bias_add,
            params_dtype,
            prefix,
            return_bias=return_bias,
            disable_tp=disable_tp,
            quant_config=quant_config,
        )
        self.gather_output = gather_output
        self.input_size_per_partition = input_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # One entry per checkpoint tensor packed into W (subclasses set it first).
        if not hasattr(self, "output_sizes"):
            self.output_sizes = list(output_sizes) if output_sizes else [output_size]
        self.output_partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            self.output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        self._make_bias(
            self.output_size_per_partition, {"output_dim": 0, "weight_loader": self.weight_loader}
        )

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        if _maybe_load_gguf(param, loaded_weight):
            return
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            shard_size = param.data.shape[output_dim]
            loaded_weight = _rank_slice(
                loaded_weight, output_dim, shard_size, self.tp_rank, shard_size * self.tp_size
            )
        _copy_checked(self.prefix, "parameter", param.data, loaded_weight)

    def forward(self, x: torch.Tensor):
        bias = None if self.skip_bias_add else self.bias
        output = self.quant_method.apply(self, x, bias)  # [T, out / tp]
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output)  # [T, out]
        return self._finish(output)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input, stacked row-wise.

    ``output_sizes=[inter, inter]`` packs ``gate_proj`` (shard 0) and
    ``up_proj`` (shard 1): ``W`` is ``[2 * inter, hidden]`` and shard ``i``
    lives at rows ``sum(output_sizes[:i]) : sum(output_sizes[:i+1])``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            gather_output,
            skip_bias_add,
            params_dtype,
            prefix=prefix,
            return_bias=return_bias,
            disable_tp=disable_tp,
            quant_config=quant_config,
        )

    def weight_loader(
        self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        if _maybe_load_gguf(param, loaded_weight, loaded_shard_id):
            return
        output_dim = param.output_dim
        if loaded_shard_id is None:
            # The checkpoint already holds the fused tensor: load it shard by shard.
            _check_fused_size(self.prefix, loaded_weight, output_dim, self.output_sizes)
            offset = 0
            for shard_id, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard_id)
                offset += size
            return
        if not isinstance(loaded_shard_id, int) or not 0 <= loaded_shard_id < len(
            self.output_sizes
        ):
            raise ValueError(
                f"{self.prefix}: shard id must be an int in [0, {len(self.output_sizes) - 1}], "
                f"got {loaded_shard_id!r}"
            )
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        loaded_weight = _rank_slice(
            loaded_weight, output_dim, shard_size, self.tp_rank, self.output_sizes[loaded_shard_id]
        )
        _copy_checked(self.prefix, f"shard {loaded_shard_id}", param_data, loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """The attention input projection: q, k and v stacked in one matrix.

    ``W`` is ``[(H + 2 * H_kv) * D, hidden]``; rows ``[0, H*D)`` are q,
    ``[H*D, (H+H_kv)*D)`` are k, the rest v. Under tensor parallelism heads are
    split across ranks; when there are fewer KV heads than ranks each KV head
    is replicated (``num_kv_head_replicas``).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = 1 if disable_tp else get_tensor_model_parallel_world_size()
        if tp_size > self.total_num_kv_heads and tp_size % self.total_num_kv_heads != 0:
            raise ValueError(
                f"{prefix or 'qkv_proj'}: tensor_parallel_size {tp_size} must be a multiple of "
                f"the number of KV heads ({self.total_num_kv_heads}) when it exceeds them"
            )
        self.num_heads = divide(self.total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        self.output_sizes = [
            self.num_heads * head_size * tp_size,  # q_proj
            self.num_kv_heads * head_size * tp_size,  # k_proj
            self.num_kv_heads * head_size * tp_size,  # v_proj
        ]
        super().__init__(
            hidden_size,
            sum(self.output_sizes),
            bias,
            False,
            skip_bias_add,
            params_dtype,
            prefix=prefix,
            return_bias=return_bias,
            disable_tp=disable_tp,
            quant_config=quant_config,
        )

    def _get_shard_offset_mapping(self, loaded_shard_id: str) -> int:
        return {
            "q": 0,
            "k": self.num_heads * self.head_size,
            "v": (self.num_heads + self.num_kv_heads) * self.head_size,
        }[loaded_shard_id]

    def _get_shard_size_mapping(self, loaded_shard_id: str) -> int:
        return {
            "q": self.num_heads * self.head_size,
            "k": self.num_kv_heads * self.head_size,
            "v": self.num_kv_heads * self.head_size,
        }[loaded_shard_id]

    def weight_loader(
        self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        if _maybe_load_gguf(param, loaded_weight, loaded_shard_id):
            return
        output_dim = param.output_dim
        # What the checkpoint holds for q, k and v (all heads, once each).
        checkpoint_sizes = [
            self.total_num_heads * self.head_size,
            self.total_num_kv_heads * self.head_size,
            self.total_num_kv_heads * self.head_size,
        ]
        if loaded_shard_id is None:
            # A fused qkv tensor in the checkpoint: split it by the full sizes.
            _check_fused_size(self.prefix, loaded_weight, output_dim, checkpoint_sizes)
            offset = 0
            for shard_id, size in zip(("q", "k", "v"), checkpoint_sizes):
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard_id)
                offset += size
            return
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(
                f"{self.prefix}: shard id must be 'q', 'k' or 'v', got {loaded_shard_id!r}"
            )
        shard_offset = self._get_shard_offset_mapping(loaded_shard_id)
        shard_size = self._get_shard_size_mapping(loaded_shard_id)
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        # q heads are split by rank; a replicated KV head is shared by
        # num_kv_head_replicas consecutive ranks.
        shard_rank = (
            self.tp_rank if loaded_shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        )
        full_size = checkpoint_sizes[("q", "k", "v").index(loaded_shard_id)]
        loaded_weight = _rank_slice(loaded_weight, output_dim, shard_size, shard_rank, full_size)
        _copy_checked(self.prefix, f"shard {loaded_shard_id!r}", param_data, loaded_weight)


class RowParallelLinear(LinearBase):
    """``y = x W^T + b`` with ``W``'s input columns split across ranks.

    Rank r multiplies its slice of ``x`` by its ``[out, in/tp]`` block; the
    partial results would be summed by an all-reduce (``reduce_results``).
    The bias is added once (rank 0), not once per rank.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(
            input_size,
            output_size,
            bias,
            skip_bias_add,
            params_dtype,
            prefix,
            return_bias=return_bias,
            disable_tp=disable_tp,
            quant_config=quant_config,
        )
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self.quant_method.create_weights(
            self,
            self.input_size_per_partition,
            self.output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        # The bias is not sharded: it has no input dimension.
        self._make_bias(output_size, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        if _maybe_load_gguf(param, loaded_weight):
            return
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            shard_size = param.data.shape[input_dim]
            loaded_weight = _rank_slice(
                loaded_weight, input_dim, shard_size, self.tp_rank, shard_size * self.tp_size
            )
        _copy_checked(self.prefix, "parameter", param.data, loaded_weight)

    def forward(self, x: torch.Tensor):
        # x is [T, in / tp] when input_is_parallel (the previous column-parallel
        # layer left it split); otherwise this rank takes its columns of x.
        if not self.input_is_parallel and self.tp_size > 1:
            x = x.narrow(
                -1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition
            )
        # The bias is added once, by rank 0, so the sum counts it once.
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = self.quant_method.apply(self, x, bias)  # [T, out]: a partial sum
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return self._finish(output)
