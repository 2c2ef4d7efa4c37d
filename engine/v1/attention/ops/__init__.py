"""Triton kernels behind the ``TRITON_ATTN`` backend.

vLLM twin: ``vllm/v1/attention/ops/`` (an empty package there). Sessions: 05.

  * ``triton_reshape_and_cache_flash`` -- write this step's K/V into the paged
    cache through ``slot_mapping``;
  * ``triton_unified_attention`` -- one kernel for every request shape
    (prefill, prefill after a prefix-cache hit, chunked prefill, decode);
  * ``triton_decode_attention`` -- split-KV decode for small batches of
    query-length-1 requests.

Importing these modules imports ``triton``; the CPU backend never does.
Whether ``@triton.jit`` builds GPU kernels or runs them in Triton's NumPy
interpreter (on CPU tensors) is read from ``TRITON_INTERPRET=1`` when each
function is decorated -- Triton's own ``tl.zeros``/``tl.max`` when triton is
first imported, ours when a module here is -- so set it before anything
imports triton (tests/v1/attention/test_triton_attn.py shows how).
"""

from __future__ import annotations


def _fix_interpreter_scalar_index() -> None:
    """Let Triton 3.6's interpreter use a loaded scalar as a ``range`` bound under NumPy >= 2.4.

    The interpreter holds every scalar as a 1-element array and converts it
    with ``int(array)``, which NumPy 2.4 rejects for arrays with ndim > 0
    (triton-lang/triton#9171, fixed upstream after 3.6). Our kernels loop
    ``for start in range(0, kv_end, TILE_SIZE)`` with ``kv_end`` read from
    ``seq_lens``, so without this the interpreter (CPU tests,
    ``TRITON_INTERPRET=1``) fails. We wrap the interpreter's tensor patching
    to convert with ``.item()`` instead. Compiled GPU kernels never run this
    code.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - triton without its interpreter
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_glassbox_scalar_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._glassbox_scalar_index_fix = True
    interpreter._patch_lang_tensor = patched


_fix_interpreter_scalar_index()
