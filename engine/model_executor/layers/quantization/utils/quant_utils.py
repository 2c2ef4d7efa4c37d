"""GroupShape: which entries of a tensor share one quantization scale.

vLLM twin: ``vllm/model_executor/layers/quantization/utils/quant_utils.py``
(``GroupShape``).
Read it for the vocabulary of scales: ``(rows, cols)`` of the block that one
scale covers, with -1 meaning "the whole dimension". For activations
``[tokens, hidden]``: ``PER_TENSOR`` (-1, -1) is one scale for the batch,
``PER_TOKEN`` (1, -1) one scale per row, so a token's quantization does not
depend on the other tokens of its batch.
Sessions: 06 (quantization).

Simpler than vLLM: the shapes and their predicates only (vLLM's module also
holds scale descriptors, quant keys and the reference (de)quantizers).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple


class _RowsCols(NamedTuple):
    row: int
    col: int


class GroupShape(_RowsCols):
    PER_TENSOR: ClassVar[GroupShape]
    PER_TOKEN: ClassVar[GroupShape]

    def is_per_tensor(self) -> bool:
        return self.row == -1 and self.col == -1

    def is_per_token(self) -> bool:
        return self.row == 1 and self.col == -1


GroupShape.PER_TENSOR = GroupShape(-1, -1)
GroupShape.PER_TOKEN = GroupShape(1, -1)
