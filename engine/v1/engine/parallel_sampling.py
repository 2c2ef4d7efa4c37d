"""Fan-out of ``n > 1`` into independent child requests.

vLLM twin: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).
Read it for: EngineCore never sees ``n``. The front end turns one request with
``n`` samples into ``n`` child requests (ids ``"{index}_{parent_id}"``, each
with ``n=1`` and, when a seed is set, ``seed + index``), which share their
prompt's KV blocks through the prefix cache, and stitches their outputs back
into one ``RequestOutput``.
Sessions: 01.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams


class ParentRequest:
    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.child_requests: set[str] = set()
        # Finished samples by index, for outputs that are only sent at the end.
        self.completions: dict[int, CompletionOutput] = {}

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed = params.seed + index
        return child_id, params
