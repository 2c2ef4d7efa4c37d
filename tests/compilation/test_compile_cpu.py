"""torch.compile on the CPU: the piecewise backend changes no token.

``CompilationMode.VLLM_COMPILE`` traces ``LlamaModel`` / ``Qwen2Model`` once
with Dynamo, cuts the graph at every attention op and compiles the pieces
with Inductor's C++ backend. Compared with the same engine run eagerly (fp32,
so both runs do the same maths up to Inductor's reordering of float sums):

* greedy tokens are identical and logprobs agree to 1e-4, on the tiny Llama,
  Qwen2 and Qwen3 checkpoints with prefills chunked into mixed batches, and
  on the default model;
* a model of L layers becomes L + 1 compiled pieces with L attention calls
  between them;
* a ``compile_sizes`` entry gets code of its own; a second start-up finds the
  pieces in the on-disk cache;
* ``inductor_compile_config`` reaches Inductor for every piece and keys the
  cache;
* bad settings fail with one line naming the field.

Engines run in this process so ``compilation_counter`` sees the compiles.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.compilation.counter import compilation_counter
from engine.config.compilation import CompilationConfig
from engine.outputs import RequestOutput
from tests.helpers.hf_checkpoints import TINY_CONFIG, default_model_path, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("in_process_engine")

LOGPROB_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
# Prompts of 5..70 tokens under a 32-token budget: chunked prefills share steps
# with decodes, so the compiled model sees many token counts.
PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % TINY_CONFIG["vocab_size"] for j in range(n)]}
    for i, n in enumerate((5, 19, 33, 70))
]
ENGINE_ARGS = {
    "skip_tokenizer_init": True,
    "max_model_len": 128,
    "max_num_batched_tokens": 32,
    "num_gpu_blocks_override": 64,
}


def _run(model: str, prompts: list, **compilation: object) -> list[RequestOutput]:
    llm = LLM(model, compilation_config=compilation or None, **ENGINE_ARGS)
    try:
        return llm.generate(prompts, GREEDY)
    finally:
        llm.llm_engine.engine_core.shutdown()


def _assert_same(eager: list[RequestOutput], compiled: list[RequestOutput]) -> None:
    for a, b in zip(eager, compiled, strict=True):
        ids = list(a.outputs[0].token_ids)
        assert list(b.outputs[0].token_ids) == ids
        assert b.outputs[0].logprobs is not None and a.outputs[0].logprobs is not None
        for pos, (la, lb) in enumerate(zip(a.outputs[0].logprobs, b.outputs[0].logprobs)):
            assert la.keys() == lb.keys(), pos
            for token, entry in la.items():
                assert abs(entry.logprob - lb[token].logprob) <= LOGPROB_ATOL, (pos, token)


@pytest.mark.parametrize(
    "arch,backend",
    # Inductor for Llama (code generation, and the cache on a second start);
    # Dynamo + split + eager pieces for the others (same split, no C++ build).
    [("llama", "inductor"), ("qwen2", "eager"), ("qwen3", "eager")],
)
def test_compiled_tokens_equal_eager(arch: str, backend: str, tmp_path: Path) -> None:
    model = tmp_path / arch
    save_tiny_checkpoint(arch, model, seed=0)
    eager = _run(str(model), PROMPTS)
    before = compilation_counter.clone()
    compiled = _run(str(model), PROMPTS, mode=3, backend=backend, cache_dir=str(tmp_path / "cc"))
    _assert_same(eager, compiled)
    layers = TINY_CONFIG["num_hidden_layers"]
    assert compilation_counter.num_graphs_seen - before.num_graphs_seen == 1
    # L attention splits and L + 1 pieces around them.
    pieces = compilation_counter.num_piecewise_capturable_graphs_seen
    assert pieces - before.num_piecewise_capturable_graphs_seen == layers + 1
    assert compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen == (
        2 * layers + 1
    )
    if backend == "inductor":
        # A fixed size compiles every piece again; a second start reads the cache.
        before = compilation_counter.clone()
        again = _run(
            str(model),
            PROMPTS,
            mode=3,
            compile_sizes=[8],
            cache_dir=str(tmp_path / "cc"),
        )
        _assert_same(eager, again)
        compiles = compilation_counter.num_backend_compilations - before.num_backend_compilations
        assert compiles == 2 * (layers + 1)  # general shape + size 8, per piece
        assert compilation_counter.num_cache_hits - before.num_cache_hits >= layers + 1


def test_default_model_compiled_equals_eager(tmp_path: Path) -> None:
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    args = {**ENGINE_ARGS, "skip_tokenizer_init": False, "max_num_batched_tokens": 64}
    model = default_model_path()
    eager = LLM(model, **args)
    compiled = LLM(model, compilation_config={"mode": 3, "cache_dir": str(tmp_path)}, **args)
    try:
        _assert_same(eager.generate(prompts, GREEDY), compiled.generate(prompts, GREEDY))
    finally:
        eager.llm_engine.engine_core.shutdown()
        compiled.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"mode": 7}, "compilation_config.mode must be one of 0-3"),
        ({"mode": "fast"}, "compilation_config.mode must be one of 0-3"),
        ({"backend": "tvm"}, "compilation_config.backend must be one of"),
        ({"splitting_ops": ["attention"]}, "splitting_ops entries are 'namespace::op'"),
        ({"compile_sizes": [0]}, "compile_sizes entries are positive integers"),
        ({"custom_ops": ["rms_norm"]}, "custom_ops entries are 'all', 'none'"),
        ({"inductor_compile_config": ["combo_kernels"]}, "inductor_compile_config must be a dict"),
        (
            {"inductor_compile_config": {"combo_kernel": True}},
            "'combo_kernel' is not an option of torch._inductor.config",
        ),
    ],
)
def test_bad_settings_name_the_field(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompilationConfig(**settings)


def test_custom_ops_default_follows_the_compiler() -> None:
    assert CompilationConfig(mode=3).custom_ops == ["none"]
    assert CompilationConfig(mode=3, backend="eager").custom_ops == ["all"]
    assert CompilationConfig().custom_ops == []  # the level's mode decides
    assert CompilationConfig(mode=0).custom_ops == ["all"]
    config = CompilationConfig(mode=3, custom_ops=["+rms_norm"])
    assert config.is_custom_op_enabled("rms_norm") and not config.is_custom_op_enabled("silu")
    config = CompilationConfig(custom_ops=["all", "-rms_norm"])
    assert not config.is_custom_op_enabled("rms_norm") and config.is_custom_op_enabled("silu")


def test_cudagraph_mode_queries() -> None:
    from engine.config.compilation import CUDAGraphMode as M

    assert [m.name for m in M if m.has_piecewise_cudagraphs()] == [
        "PIECEWISE",
        "FULL_AND_PIECEWISE",
    ]
    assert [m.name for m in M if m.has_full_cudagraphs()] == [
        "FULL",
        "FULL_DECODE_ONLY",
        "FULL_AND_PIECEWISE",
    ]
    assert [m.name for m in M if m.is_valid_runtime_mode()] == ["NONE", "PIECEWISE", "FULL"]
    assert M.FULL_DECODE_ONLY.has_mode(M.NONE) and not M.FULL_DECODE_ONLY.has_mode(M.PIECEWISE)
    assert M.FULL_AND_PIECEWISE.max_cudagraph_mode() == M.FULL
    assert M.PIECEWISE.max_cudagraph_mode() == M.PIECEWISE


@pytest.mark.parametrize(
    "device_type,mode,wrapped",
    [
        ("cuda", "PIECEWISE", True),
        ("cuda", "FULL_AND_PIECEWISE", True),
        ("cuda", "FULL_DECODE_ONLY", True),  # the runner may settle on FULL_AND_PIECEWISE
        ("cuda", "NONE", False),
        ("cpu", "PIECEWISE", False),
    ],
)
def test_pieces_get_a_piecewise_graph_wrapper_only_on_cuda(
    device_type: str, mode: str, wrapped: bool, tmp_path: Path
) -> None:
    """The backend's wrapping decision, made without a GPU (the wrapper only
    touches CUDA when a PIECEWISE step calls it)."""
    import torch
    from torch import fx

    from engine.compilation.backends import GlassboxBackend
    from engine.compilation.cuda_graph import CUDAGraphWrapper
    from engine.compilation.piecewise_backend import PiecewiseBackend
    from engine.config.compilation import CUDAGraphMode

    config = CompilationConfig(mode=3, backend="eager", cache_dir=str(tmp_path))
    config.cudagraph_mode = CUDAGraphMode[mode]
    backend = GlassboxBackend(config, "key", device_type)
    piece = backend.compile_piece(fx.symbolic_trace(torch.nn.ReLU()), [torch.ones(2)], 0, [])
    if wrapped:
        assert isinstance(piece, CUDAGraphWrapper)
        assert piece.runtime_mode == CUDAGraphMode.PIECEWISE
        assert isinstance(piece.unwrap(), PiecewiseBackend)
    else:
        assert isinstance(piece, PiecewiseBackend)
    # Outside a forward context (or in an eager step) the wrapper calls through.
    assert torch.equal(piece(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


def test_compilation_is_traced_and_shown(tmp_path: Path) -> None:
    from engine.tracing import RunnerCompiled, load_trace
    from tui.session import open_session

    model = tmp_path / "llama"
    save_tiny_checkpoint("llama", model, seed=0)
    trace = tmp_path / "trace.jsonl"
    compilation = {"mode": 3, "backend": "eager", "compile_sizes": [4], "cache_dir": str(tmp_path)}
    llm = LLM(str(model), compilation_config=compilation, trace_path=str(trace), **ENGINE_ARGS)
    llm.generate(PROMPTS[:2], GREEDY)
    llm.shutdown()
    (event,) = [e for e in load_trace(str(trace)) if isinstance(e, RunnerCompiled)]
    layers = TINY_CONFIG["num_hidden_layers"]
    assert (event.mode, event.backend) == ("VLLM_COMPILE", "eager")
    assert (event.num_pieces, event.num_splits) == (layers + 1, layers)
    assert event.compile_sizes == [4] and list(event.size_seconds) == ["4"]
    assert event.inductor_compiles == event.cache_hits == 0  # eager: no code generated
    assert 0 < event.backend_seconds <= event.seconds
    assert event.cache_dir.startswith(str(tmp_path))
    assert event.inductor_options == {"enable_auto_functionalized_v2": False}
    assert open_session(str(trace)).info.compilation == f"VLLM_COMPILE: {layers + 1} eager pieces"


# STOCK_TORCH_COMPILE, DYNAMO_TRACE_ONCE; with Inductor, attention's in-place
# output goes through its functionalization (V1, vLLM's choice).
@pytest.mark.parametrize("mode,backend", [(1, "eager"), (2, "eager"), (2, "inductor")])
def test_whole_graph_modes_equal_eager(mode: int, backend: str, tmp_path: Path) -> None:
    """Dynamo traces the whole model (attention an opaque op inside it) and
    hands it to the backend unsplit: no GlassboxBackend runs."""
    import torch

    from engine.model_executor.models.llama import LlamaModel

    model = tmp_path / "llama"
    save_tiny_checkpoint("llama", model, seed=0)
    eager = _run(str(model), PROMPTS)
    before = compilation_counter.clone()
    compilation = {"mode": mode, "backend": backend}
    llm = LLM(str(model), compilation_config=compilation, **ENGINE_ARGS)
    try:
        compiled = llm.generate(PROMPTS, GREEDY)
        forward = LlamaModel.forward.__code__
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(forward)
    finally:
        llm.llm_engine.engine_core.shutdown()
    _assert_same(eager, compiled)
    assert compilation_counter.num_models_seen - before.num_models_seen == 1
    assert compilation_counter.num_graphs_seen == before.num_graphs_seen
    # Mode 2: one trace for good, then the model runs that trace's bytecode.
    # Mode 1 keeps its guards: it retraces once the layers have picked their
    # implementations on the first call, and once more when a token count
    # differs (then the dim is dynamic for good).
    assert len(entries) == 1 if mode == 2 else 1 <= len(entries) <= 3
    # Shut down, the engine leaves no code on forward.
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(forward) == []


def test_compiled_layers_run_plain_torch_for_inductor(tmp_path: Path) -> None:
    """custom_ops "none" (Inductor's default) reaches every CustomOp and the
    Qwen3 fused q/k-norm + RoPE switch; the eager model keeps its kernels,
    also when built after a compiled one."""
    import torch

    from engine.engine.arg_utils import EngineArgs
    from engine.model_executor.custom_op import CustomOp
    from engine.model_executor.model_loader import get_model

    model = tmp_path / "qwen3"
    save_tiny_checkpoint("qwen3", model, seed=0)
    ropes = []
    # Compiled first: its choice must not reach the eager model built next.
    for mode, enabled in ((3, False), (0, True)):
        config = EngineArgs(
            model=str(model), skip_tokenizer_init=True, compilation_config={"mode": mode}
        ).create_engine_config()
        built = get_model(config, device=torch.device("cpu"), dtype=torch.float32)
        ops = [m for m in built.modules() if isinstance(m, CustomOp)]
        assert ops and all(op.is_enabled() == enabled for op in ops)
        attention = built.model.layers[0].self_attn
        assert attention.use_fused_qk_norm_rope == enabled
        # One RoPE module for the layers of a model, none shared between models.
        assert len({id(layer.self_attn.rotary_emb) for layer in built.model.layers}) == 1
        ropes.append(attention.rotary_emb)
    assert ropes[0] is not ropes[1]


def test_inductor_options_reach_every_piece(tmp_path: Path, monkeypatch) -> None:
    """The options patch every piece's compile_fx (vLLM's defaults under the
    user's) and change the cache folder. Inductor itself is replaced by the
    traced piece: what is checked is what it is handed."""
    import torch._inductor.compile_fx

    from engine.compilation.decorators import compute_cache_key
    from engine.engine.arg_utils import EngineArgs

    handed: list[dict] = []

    def compile_fx(graph, example_inputs, config_patches=None, **kwargs):
        handed.append(dict(config_patches or {}))
        return graph

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", compile_fx)
    model = tmp_path / "llama"
    save_tiny_checkpoint("llama", model, seed=0)
    options = {"size_asserts": False, "combo_kernels": True}
    _run(str(model), PROMPTS[:1], mode=3, inductor_compile_config=options, cache_dir=str(tmp_path))
    assert len(handed) == TINY_CONFIG["num_hidden_layers"] + 1
    for patches in handed:
        assert patches == {
            **options,
            "enable_auto_functionalized_v2": False,
            "fx_graph_cache": True,
            "fx_graph_remote_cache": False,
        }
    # Plain torch.compile (STOCK_TORCH_COMPILE) hands them to Inductor itself.
    handed.clear()
    _run(str(model), PROMPTS[:1], mode=1, inductor_compile_config=options)
    assert handed and all(patches.items() >= options.items() for patches in handed)

    def key(compilation: dict) -> str:
        args = EngineArgs(str(model), skip_tokenizer_init=True, compilation_config=compilation)
        return compute_cache_key(args.create_engine_config())

    assert key({"mode": 3}) != key({"mode": 3, "inductor_compile_config": options})
