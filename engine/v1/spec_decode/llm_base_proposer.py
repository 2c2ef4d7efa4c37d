"""SpecDecodeBaseProposer: draft k tokens per request with a small model of our own.

vLLM twin: ``vllm/v1/spec_decode/llm_base_proposer.py``
(``SpecDecodeBaseProposer``: ``load_model``, ``propose``,
``set_inputs_first_pass``, ``prepare_inputs``, ``dummy_run``,
``initialize_attn_backend``); the draft model and EAGLE proposers
(``draft_model.py``, ``eagle.py``) subclass it.
Read it for how a model drafts inside the engine. The drafter's attention
layers get their own KV cache tensors but share the target's block table
(``engine/v1/kv_cache_interface.py``, ``UniformTypeKVCacheSpecs``), so a slot
means the same position in both caches. After the target's step:

1. First pass, over the tokens the target just verified. Per request, the
   positions from ``num_computed_tokens`` (where the target's step began) up
   to its new last token; rejected drafts are left out, and the drafter's
   stale cache entries for them are overwritten on a later step. A request in
   the middle of its prompt runs its chunk only, to fill the drafter's cache,
   and drafts nothing. The logits at each drafting request's last position
   give draft 1 (greedy).
2. k - 1 more passes of one token per drafting request: draft j goes in at
   the next position, its KV into the lookahead slots the scheduler reserved
   (``num_lookahead_tokens``), and draft j + 1 comes out.

Which tokens the first pass reads is the subclass's choice
(``first_pass_shift``): a draft model reads the token at each position; an
EAGLE head reads the token one position later together with the target's
hidden state at the position (``pass_hidden_states_to_model``).
Sessions: 06 (speculative decoding).

Under async scheduling the host must not wait for the verdict, so
``propose_padded`` drafts from device tensors only (vLLM's padded drafter
batch, its default): the first pass runs every position the target ran this
step, rejected drafts included, with the request's next token written in at
the position after its last accepted one (``prepare_next_token_ids_padded``,
``prepare_inputs_padded``); that position, found on the device, is where
draft 1 is read, and the lookahead passes continue from it. The rejected
positions' drafter cache entries are garbage that causal attention never
reads from an earlier position, and a later step writes them again.

Simpler than vLLM: the serial loop's first pass is gathered on the host with
numpy and the padded one's index arithmetic is torch ops (vLLM has Triton
kernels for both); drafting runs eagerly (vLLM captures CUDA graphs for it);
drafts are greedy (no draft probabilities for the rejection sampler, vLLM's
default too); no tree drafting, multimodal inputs, M-RoPE or parallel
drafting. In the serial loop drafts that would reach ``max_model_len`` are
cut off here; in the padded path the scheduler cuts them (as vLLM does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.config import GlassboxConfig
from engine.config.compilation import CompilationMode, CUDAGraphMode
from engine.forward_context import set_forward_context
from engine.model_executor.layers.attention.attention import Attention
from engine.model_executor.model_loader import get_model
from engine.v1.attention.backend import CommonAttentionMetadata
from engine.v1.worker.block_table import BlockTable


@dataclass
class DraftPass:
    """One drafter forward, laid out on the host: ``rows`` are batch rows,
    each with ``query_lens[r]`` tokens (flattened in ``token_ids`` /
    ``positions``), and its context is ``seq_lens[r]`` tokens long."""

    rows: np.ndarray  # [R] batch rows, in the pass's order
    query_lens: np.ndarray  # [R]
    token_ids: np.ndarray | None  # [T]; None on the lookahead passes (drafts stay on the device)
    positions: np.ndarray  # [T]
    seq_lens: np.ndarray  # [R]
    # [T] flat index of each token's position in the target's step (EAGLE's
    # hidden state); None on the lookahead passes.
    target_indices: np.ndarray | None = None


@dataclass
class DraftInputs:
    """What the runner hands a model drafter after sampling, per batch row
    (Glassbox's own: vLLM's ``propose`` takes device tensors and attention
    metadata as arguments)."""

    sampled_token_ids: list[list[int]]  # [num_reqs][0 or more]; [] = a prompt chunk
    token_ids_cpu: np.ndarray  # [max_num_reqs, max_model_len], now with this step's tokens
    num_tokens_no_spec: np.ndarray  # [>= num_reqs] verified tokens per row
    num_computed_tokens: np.ndarray  # [>= num_reqs] where the target's step began
    num_scheduled_tokens: np.ndarray  # [num_reqs] tokens the target ran per row
    cu_num_tokens: np.ndarray  # [num_reqs] cumulative num_scheduled_tokens
    block_table: BlockTable
    target_hidden_states: torch.Tensor | None = None  # [step tokens, hidden] (EAGLE)


@dataclass
class PaddedDraftInputs:
    """What the runner hands a model drafter under async scheduling: the
    step's layout on the host, every token value on the device (Glassbox's
    own: vLLM passes these as separate arguments)."""

    target_token_ids: torch.Tensor  # [num_tokens] the step's input ids (device)
    sampled_token_ids: torch.Tensor  # [num_reqs, max_drafts + 1], -1 after the kept ones
    num_computed_tokens: np.ndarray  # [num_reqs] where the target's step began
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    num_draft_tokens: np.ndarray  # [num_reqs] drafts verified this step
    # [num_reqs] True: a prompt chunk whose sample is thrown away; its next
    # token is the prompt's (backup_next_token_ids), known on the host.
    discard_mask: np.ndarray
    backup_next_token_ids: np.ndarray  # [num_reqs]
    block_table: BlockTable
    vocab_size: int
    target_hidden_states: torch.Tensor | None = None  # [num_tokens, hidden] (EAGLE)


class SpecDecodeBaseProposer:
    # Draft model 0: the token at each position; EAGLE 1: the next one.
    first_pass_shift = 0
    pass_hidden_states_to_model = False

    def __init__(self, glassbox_config: GlassboxConfig, device: torch.device) -> None:
        spec = glassbox_config.speculative_config
        assert spec is not None and spec.draft_model_config is not None
        self.glassbox_config = glassbox_config
        self.speculative_config = spec
        self.draft_model_config = spec.draft_model_config
        self.num_speculative_tokens: int = spec.num_speculative_tokens or 0
        self.device = device
        self.max_model_len = glassbox_config.model_config.max_model_len or 0
        self.model: nn.Module | None = None
        self.dtype: torch.dtype | None = None
        self.attn_layers: dict[str, Attention] = {}
        self.attn_metadata_builder = None
        self.block_size = glassbox_config.cache_config.block_size

    # ------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------
    def _create_draft_glassbox_config(self) -> GlassboxConfig:
        """The target's config with the draft's ModelConfig, no speculation and
        no compilation (drafts run eagerly). The copied compilation config
        shares the target's table of attention layers by name."""
        compilation_config = dataclasses.replace(
            self.glassbox_config.compilation_config,
            mode=CompilationMode.NONE,
            cudagraph_mode=CUDAGraphMode.NONE,
        )
        return dataclasses.replace(
            self.glassbox_config,
            model_config=self.draft_model_config,
            speculative_config=None,
            compilation_config=compilation_config,
        )

    def _get_model(self, dtype: torch.dtype) -> nn.Module:
        # "draft_model.": layer names (and so cache tensors) apart from the target's.
        return get_model(
            self._create_draft_glassbox_config(), self.device, dtype, prefix="draft_model"
        )

    def load_model(self, target_model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.model = self._get_model(dtype)
        self._maybe_share_embeddings(target_model)
        self._maybe_share_lm_head(target_model)
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        if not self.attn_layers:
            raise ValueError("the draft model has no Attention layers")

    def _maybe_share_embeddings(self, target_model: nn.Module) -> None:
        """EAGLE reuses the target's embedding when its checkpoint has none."""

    def _maybe_share_lm_head(self, target_model: nn.Module) -> None:
        """EAGLE scores with the target's LM head."""

    def initialize_attn_backend(self) -> None:
        """A metadata builder of the drafter's own: its layers may differ in
        shape from the target's (FlashInfer plans per shape)."""
        backend = next(iter(self.attn_layers.values())).attn_backend
        self.attn_metadata_builder = backend.get_builder_cls()(self.block_size, self.device)
        if hasattr(self.attn_metadata_builder, "bind_layers"):
            self.attn_metadata_builder.bind_layers(self.attn_layers.values(), self.dtype, [])

    # ------------------------------------------------------------------
    # Drafting
    # ------------------------------------------------------------------
    def set_inputs_first_pass(self, inputs: DraftInputs) -> tuple[DraftPass, np.ndarray]:
        """The first pass, and which of its rows draft (a bool per row).

        Per batch row i, with c = num_computed_tokens[i] (where the target's
        step began) and n = num_tokens_no_spec[i] (the verified tokens now):
          drafting row (it sampled):  positions c .. n - 1 - shift
          prompt chunk (it did not):  positions c .. c + num_scheduled - 1
        Example, draft model, k = 3: c = 10, the target ran [t10 d1 d2 d3],
        accepted d1 and sampled x: n = 12 (t10 d1 x), positions 10 11 12 with
        tokens t10 d1 x; draft 1 comes from position 12. EAGLE reads d1 x and
        t11 (unknown yet) is not needed: positions 10 11, tokens d1 x.
        """
        num_reqs = len(inputs.sampled_token_ids)
        shift = self.first_pass_shift
        drafts = np.array([len(t) > 0 for t in inputs.sampled_token_ids], dtype=bool)
        starts = inputs.num_computed_tokens[:num_reqs].astype(np.int64)
        ends = np.where(
            drafts,
            inputs.num_tokens_no_spec[:num_reqs] - shift,
            starts + inputs.num_scheduled_tokens,
        ).astype(np.int64)
        query_lens = ends - starts
        # Single-token rows first: builders that split decodes from prefills
        # (FlashInfer) expect them at the front, as the runner's reorder does.
        order = np.argsort(query_lens > 1, kind="stable")
        rows, starts, query_lens = order, starts[order], query_lens[order]
        offsets = np.arange(int(query_lens.sum())) - np.repeat(
            np.cumsum(query_lens) - query_lens, query_lens
        )
        flat_rows = np.repeat(rows, query_lens)
        positions = np.repeat(starts, query_lens) + offsets
        step_starts = (inputs.cu_num_tokens - inputs.num_scheduled_tokens)[rows]
        first = DraftPass(
            rows=rows,
            query_lens=query_lens,
            token_ids=inputs.token_ids_cpu[flat_rows, positions + shift],
            positions=positions,
            seq_lens=starts + query_lens,
            target_indices=np.repeat(step_starts, query_lens) + offsets,
        )
        return first, drafts[order]

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> list[list[int]]:
        """Up to k greedy drafts per batch row ([] for rows that sampled nothing)."""
        assert self.model is not None
        num_reqs = len(inputs.sampled_token_ids)
        block_table = inputs.block_table
        first, drafting = self.set_inputs_first_pass(inputs)
        hidden_in = None
        if self.pass_hidden_states_to_model:
            target_hidden = inputs.target_hidden_states
            assert target_hidden is not None and first.target_indices is not None
            hidden_in = target_hidden[torch.from_numpy(first.target_indices).to(self.device)]
        last_hidden, hidden_out = self._run(first, block_table, hidden_in)
        # Each drafting row's last token: its logits give draft 1.
        out: list[list[int]] = [[] for _ in range(num_reqs)]
        rows = first.rows[drafting]
        if not len(rows):  # only prompt chunks: their caches are filled, nothing to draft
            return out
        last_index = np.cumsum(first.query_lens) - 1
        sample_at = torch.from_numpy(last_index[drafting]).to(self.device)
        draft_ids = [self._greedy_sample(last_hidden[sample_at])]

        last_positions = first.positions[last_index[drafting]]
        hidden = hidden_out[sample_at] if hidden_out is not None else None
        for j in range(1, self.num_speculative_tokens):
            # Draft j enters one position after the last token run.
            positions = last_positions + j
            step = DraftPass(
                rows=rows,
                query_lens=np.ones(len(rows), dtype=np.int64),
                token_ids=None,
                positions=positions,
                seq_lens=positions + 1,
            )
            last_hidden, hidden_out = self._run(step, block_table, hidden, input_ids=draft_ids[-1])
            hidden = hidden_out
            draft_ids.append(self._greedy_sample(last_hidden))

        drafts = torch.stack(draft_ids, dim=1).tolist()  # [drafting rows, k]; waits for the device
        # Drafts must not carry a request past max_model_len.
        for row, row_drafts in zip(rows.tolist(), drafts):
            room = self.max_model_len - int(inputs.num_tokens_no_spec[row])
            out[row] = row_drafts[: max(room, 0)]
        return out

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        assert self.model is not None
        return self.model.compute_logits(hidden_states).argmax(dim=-1)

    def _run(
        self,
        draft_pass: DraftPass,
        block_table: BlockTable,
        hidden_states: torch.Tensor | None,
        input_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One drafter forward over ``draft_pass``: (hidden states to score,
        hidden states for the next pass (EAGLE) or None)."""
        assert self.model is not None and self.attn_metadata_builder is not None
        p = draft_pass
        positions = p.positions.copy()
        token_rows = np.repeat(p.rows, p.query_lens)
        # A lookahead position at or past max_model_len writes nowhere and
        # reads a one-token context; its drafts are cut off in propose().
        beyond = positions >= self.max_model_len
        positions[beyond] = 0
        slot_mapping = block_table.compute_slot_mapping(token_rows, positions)
        slot_mapping[beyond] = -1
        query_start_loc = np.zeros(len(p.rows) + 1, dtype=np.int32)
        query_start_loc[1:] = np.cumsum(p.query_lens)
        seq_lens = np.where(beyond[query_start_loc[1:] - 1], 1, p.seq_lens).astype(np.int32)
        to_device = self._to_device
        common = CommonAttentionMetadata(
            query_start_loc=to_device(query_start_loc),
            query_start_loc_cpu=torch.from_numpy(query_start_loc),
            seq_lens=to_device(seq_lens),
            _seq_lens_cpu=torch.from_numpy(seq_lens),
            num_reqs=len(p.rows),
            num_actual_tokens=len(positions),
            max_query_len=int(p.query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table.block_table[to_device(p.rows.astype(np.int64))],
            slot_mapping=to_device(slot_mapping.astype(np.int64)),
        )
        if input_ids is None:
            assert p.token_ids is not None
            input_ids = to_device(p.token_ids.astype(np.int64))
        return self._forward(common, input_ids, to_device(positions), hidden_states)

    def _forward(
        self,
        common: CommonAttentionMetadata,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.model is not None and self.attn_metadata_builder is not None
        metadata = self.attn_metadata_builder.build(common)
        kwargs = {}
        if self.pass_hidden_states_to_model:
            kwargs["hidden_states"] = hidden_states
        with set_forward_context(
            {name: metadata for name in self.attn_layers}, self.glassbox_config
        ):
            out = self.model(input_ids, positions, **kwargs)
        if isinstance(out, tuple):  # EAGLE: (to score, to feed the next pass)
            return out[0], out[1]
        return out, None

    # ------------------------------------------------------------------
    # Drafting without a host sync (async scheduling)
    # ------------------------------------------------------------------
    def prepare_next_token_ids_padded(
        self, inputs: PaddedDraftInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next token per row, tokens kept per row), both on the device.
        A row's next token is its last kept token, or for a prompt chunk the
        prompt's next token. Example: sampled [[5, 9, -1, -1], [7, -1, -1, -1]]
        -> next [9, 7], kept [2, 1]."""
        sampled = inputs.sampled_token_ids
        valid = (sampled != -1) & (sampled < inputs.vocab_size)
        num_valid = valid.sum(dim=1)
        last = sampled.gather(1, (num_valid - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        discard = self._to_device(inputs.discard_mask)
        backup = self._to_device(inputs.backup_next_token_ids.astype(np.int64))
        next_token_ids = torch.where(discard, backup, last.long())
        return next_token_ids, torch.where(discard, 0, num_valid)

    def prepare_inputs_padded(
        self, inputs: PaddedDraftInputs, num_valid: torch.Tensor
    ) -> tuple[DraftPass, torch.Tensor, torch.Tensor]:
        """The first pass over every position the target ran (a draft model
        also runs the one after: it reads the token at each position, EAGLE
        the next one), and where each row's next token goes: the flat index
        right after its last accepted token, on the device.

        Example, k = 3, c = 10, the target ran [t10 d1 d2 d3], kept d1 and x
        (2 tokens, 2 drafts rejected): EAGLE runs positions 10..13 with tokens
        [d1 x d3 .] (x written at index 1 = 4 - 1 - 2); a draft model runs
        10..14 with [t10 d1 x d3 .] (x at index 2). Returns (the pass, the
        pass's token ids, token_indices_to_sample)."""
        shift = self.first_pass_shift
        extra = 1 - shift  # a draft model runs one position more per row
        num_scheduled = inputs.num_scheduled_tokens.astype(np.int64)
        num_reqs = len(num_scheduled)
        query_lens = num_scheduled + extra
        cu = np.cumsum(query_lens)
        offsets = np.arange(int(cu[-1])) - np.repeat(cu - query_lens, query_lens)
        starts = inputs.num_computed_tokens[:num_reqs].astype(np.int64)
        # Each token's source in the target's step, -1 past its row's end.
        target_starts = np.cumsum(num_scheduled) - num_scheduled
        src = np.repeat(target_starts, query_lens) + offsets + shift
        src[offsets + shift >= np.repeat(num_scheduled, query_lens)] = -1
        src_t = self._to_device(src)
        token_ids = inputs.target_token_ids[src_t.clamp(min=0)]
        # Each row's next token goes after its accepted tokens.
        num_rejected = torch.where(
            num_valid > 0, self._to_device(inputs.num_draft_tokens) - (num_valid - 1), 0
        )
        # The row's last index, minus one per rejected draft.
        token_indices_to_sample = self._to_device(cu - 1) - num_rejected
        first = DraftPass(
            rows=np.arange(num_reqs),
            query_lens=query_lens,
            token_ids=None,
            positions=np.repeat(starts, query_lens) + offsets,
            seq_lens=starts + query_lens,
        )
        return first, token_ids, token_indices_to_sample

    @torch.inference_mode()
    def propose_padded(self, inputs: PaddedDraftInputs) -> torch.Tensor:
        """k greedy drafts per row, [num_reqs, k] on the device; the host
        waits for nothing. Rows that drafted nothing useful (prompt chunks)
        get drafts too; the scheduler never schedules them."""
        assert self.model is not None
        next_token_ids, num_valid = self.prepare_next_token_ids_padded(inputs)
        first, token_ids, sample_at = self.prepare_inputs_padded(inputs, num_valid)
        token_ids = token_ids.scatter(0, sample_at, next_token_ids.to(token_ids.dtype))
        hidden_in = None
        if self.pass_hidden_states_to_model:  # same positions as the target's step
            hidden_in = inputs.target_hidden_states
        last_hidden, hidden_out = self._run(first, inputs.block_table, hidden_in, token_ids)
        draft_ids = [self._greedy_sample(last_hidden[sample_at])]
        positions = self._to_device(first.positions)[sample_at]
        hidden = hidden_out[sample_at] if hidden_out is not None else None
        # Host bound for the lookahead passes' context (the device has the value).
        max_seq_len = int(first.seq_lens.max())
        for j in range(1, self.num_speculative_tokens):
            last_hidden, hidden = self._run_lookahead(
                positions + j, max_seq_len + j, inputs.block_table, draft_ids[-1], hidden
            )
            draft_ids.append(self._greedy_sample(last_hidden))
        return torch.stack(draft_ids, dim=1)

    def _run_lookahead(
        self,
        positions: torch.Tensor,
        max_seq_len: int,
        block_table: BlockTable,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row at device-known ``positions`` (rows in batch
        order): slots and context lengths are computed on the device. A
        position at or past max_model_len writes nowhere (its drafts are cut
        by the scheduler)."""
        assert self.model is not None and self.attn_metadata_builder is not None
        num_reqs = positions.shape[0]
        beyond = positions >= self.max_model_len
        positions = torch.where(beyond, 0, positions)
        table = block_table.block_table[:num_reqs]
        block_ids = table.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
        slot_mapping = block_ids.long() * self.block_size + positions % self.block_size
        slot_mapping = torch.where(beyond, -1, slot_mapping)
        seq_lens = torch.where(beyond, 1, positions + 1).to(torch.int32)
        query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=query_start_loc.to(self.device, non_blocking=True),
            query_start_loc_cpu=query_start_loc,
            seq_lens=seq_lens,
            num_reqs=num_reqs,
            num_actual_tokens=num_reqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_table_tensor=table,
            slot_mapping=slot_mapping,
            # On the CPU the "device" values are host values already.
            _seq_lens_cpu=seq_lens if seq_lens.device.type == "cpu" else None,
        )
        return self._forward(common, input_ids, positions, hidden_states)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        # non_blocking: a pageable host copy is staged at once; no wait for the device.
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """A forward over ``num_tokens`` dummy tokens with no KV cache, for the
        memory profile that sizes the KV cache."""
        assert self.model is not None
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        kwargs = {}
        if self.pass_hidden_states_to_model:
            hidden_size = int(self.draft_model_config.hf_config["hidden_size"])
            kwargs["hidden_states"] = torch.zeros(
                num_tokens, hidden_size, device=self.device, dtype=self.dtype
            )
        with set_forward_context(None, self.glassbox_config):
            out = self.model(input_ids, input_ids, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        max_num_seqs = self.glassbox_config.scheduler_config.max_num_seqs
        self.model.compute_logits(hidden[: min(num_tokens, max_num_seqs)])
