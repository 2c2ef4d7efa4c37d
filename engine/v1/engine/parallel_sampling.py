"""Fan-out of ``n > 1`` into independent child requests, and back.

vLLM twin: ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).
Read it for: EngineCore never sees ``n``. The front end turns one request with
``n`` samples into ``n`` child requests -- ids ``"{index}_{parent internal
id}"``, each with ``n=1`` and, when a seed is set, ``seed + index`` -- which
share their prompt's KV blocks through the prefix cache. ``get_outputs``
stitches the children's outputs back into the parent's: while streaming, each
child's update goes out as it comes (a finished child only once); with
``FINAL_ONLY`` nothing goes out until the last child has finished, then all
``n`` together. The parent's internal id carries a random suffix, so no id a
client can choose is ever equal to a child's id.
Sessions: 01.

Simpler than vLLM: no iteration stats object; ``observe_num_generation_tokens``
only keeps the running maximum.
"""

from __future__ import annotations

from engine.outputs import CompletionOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.v1.engine import EngineCoreRequest


class ParentRequest:
    """The ``n > 1`` request as the user sent it, and its children's progress."""

    def __init__(self, request: EngineCoreRequest) -> None:
        assert request.external_req_id is not None, "call assign_request_id first"
        self.request_id = request.request_id  # internal
        self.external_req_id = request.external_req_id
        self.sampling_params = request.params
        # Children still running (their request ids).
        self.child_requests: set[str] = set()
        # FINAL_ONLY: one slot per sample, filled as children finish.
        final_only = self.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        self.output_aggregator: list[CompletionOutput | None] = (
            [None] * self.n if final_only else []
        )
        # Longest child so far, in generated tokens (for stats).
        self.max_num_generation_tokens = 0
        # Unseeded children can all share one params object.
        self.cached_child_sampling_params: SamplingParams | None = None

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def _get_child_sampling_params(self, index: int) -> SamplingParams:
        if self.cached_child_sampling_params is not None:
            return self.cached_child_sampling_params
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is None:
            self.cached_child_sampling_params = params
        else:
            # Same seed would give n identical samples.
            params.seed = params.seed + index
        return params

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The id and params of child ``index``; it is now counted as running."""
        child_id = f"{index}_{self.request_id}"
        self.child_requests.add(child_id)
        return child_id, self._get_child_sampling_params(index)

    def get_outputs(
        self, child_request_id: str, completion_output: CompletionOutput
    ) -> tuple[list[CompletionOutput], bool]:
        """What to send the user for one child's update, and whether the
        whole request is now finished.

        A finished child leaves ``child_requests``; an update for a child
        that already left (it was sent finished before) sends nothing."""
        already_sent_finished = False
        if completion_output.finished():
            if child_request_id in self.child_requests:
                self.child_requests.remove(child_request_id)
            else:
                already_sent_finished = True
        if self.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [] if already_sent_finished else [completion_output]
        else:
            self.output_aggregator[completion_output.index] = completion_output
            outputs = [] if self.child_requests else list(self.output_aggregator)
        return outputs, not self.child_requests  # type: ignore[return-value]

    def observe_num_generation_tokens(self, num_generation_tokens: int) -> int:
        """Record one child's length; returns the longest so far."""
        self.max_num_generation_tokens = max(self.max_num_generation_tokens, num_generation_tokens)
        return self.max_num_generation_tokens
