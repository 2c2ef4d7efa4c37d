"""Compiled CPU kernels (``csrc/cpu/``), built on first use.

vLLM twin: the CPU entries of ``vllm/_custom_ops.py`` (``cpu_attention_with_kv_cache``
and friends), which call ``torch.ops._C`` ops compiled from ``csrc/cpu/`` when vLLM
is built for the CPU. Read it for how a pure-Python project gets a C++ kernel
without a build step: ``torch.utils.cpp_extension.load`` compiles the sources
with the system's C++ compiler, once per machine and source version, into
``$GLASSBOX_CACHE/torch_extensions`` (default ``~/.cache/glassbox``) and imports
the result. ``make setup`` builds it, so tests and the first engine do not wait
for it; only a process that runs the model on the CPU ever asks for it
(``cpu_kernels()``), so the CLI, the API server's front end and the TUI never do.

Build time: five files, about 2 minutes of CPU time in all (``#include
<torch/extension.h>`` dominates each one); ninja compiles them in parallel, so
68 s on an idle 2-core machine, 3.7 minutes on 2 cores that other jobs kept at
a load of 3-4, and 7 minutes have been seen. A build prints what it is doing,
and each file as it is done, on stderr (``BUILD_TIME_HINT``, ``_BuildProgress``).

Ops (all in place into ``out``, float32, CPU tensors):

  ``paged_decode_attention(out, query, key_cache, value_cache, block_table,
  seq_lens, scale)``
      decode attention for one query token per request over a paged KV cache
      ``[num_blocks, block_size, H_kv, D]``, reading each block where it lies
      (``csrc/cpu/cpu_attn.cpp``). Used by the ``CPU_ATTN`` backend's decode rows.

When the kernels cannot be built (no compiler, no ninja) or
``GLASSBOX_CPU_KERNELS=0``, ``cpu_kernels()`` returns None and callers keep their
plain-torch path -- same maths, slower; the reason is logged once.
``with kernels_disabled():`` does the same for a block of code.
Sessions: 05 (attention backends).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CPU_KERNELS_ENV = "GLASSBOX_CPU_KERNELS"
SOURCES = (
    "cpu/torch_bindings.cpp",
    "cpu/cpu_attn.cpp",
    "cpu/layernorm.cpp",
    "cpu/activation.cpp",
    "cpu/pos_encoding.cpp",
)
HEADERS = ("cpu/parallel.hpp",)  # copied beside the sources, part of the build's name
CSRC_DIR = Path(__file__).resolve().parent.parent / "csrc"
# Measured with `time python -m engine._cpu_ops` on 2 cores: 68 s idle, 219 s while
# other jobs kept the load at 3-4.
BUILD_TIME_HINT = "about 1 minute on 2 idle cores, 4 minutes or more on 2 busy ones"
# How often the progress reporter looks for finished object files, and how long
# it stays quiet before saying the build is still running.
PROGRESS_POLL_S = 1.0
PROGRESS_HEARTBEAT_S = 30.0


def _build_name(texts: list[bytes]) -> str:
    """Sources and this CPU's instruction sets in the name: -march=native code
    must not be loaded on another kind of CPU sharing the cache directory."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text)
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = ""
    digest.update(flags.encode())
    return f"glassbox_cpu_kernels_{digest.hexdigest()[:12]}"


# > 0 inside ``kernels_disabled()``: every caller gets None, i.e. its torch path.
_disabled_depth = 0


@contextmanager
def kernels_disabled() -> Iterator[None]:
    """Within the block, ``cpu_kernels()`` returns None everywhere: the layers and
    ``CPU_ATTN`` take their plain-torch paths (tests comparing the two paths,
    notebooks counting torch ops; a C++ call is invisible to a dispatch mode)."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


def cpu_kernels() -> ModuleType | None:
    """The compiled module, or None (disabled, not buildable here, or while
    torch.compile traces: Dynamo cannot see into a pybind extension, so the
    callers' plain-torch path goes into the graph instead)."""
    import torch  # only model code calls this; torch is loaded by then

    if _disabled_depth or torch.compiler.is_compiling():
        return None
    return _load_once()


@lru_cache(maxsize=1)
def _load_once() -> ModuleType | None:
    if os.environ.get(CPU_KERNELS_ENV, "1") == "0":
        return None
    try:
        return load(verbose=False)
    except Exception as e:  # no compiler, no ninja, a compile error: keep the torch path
        logger.warning(
            "CPU kernels unavailable (%s: %s); using the plain-torch paths",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


class _BuildProgress:
    """Reports a running build on stderr: each source file as its object file
    appears, and a line every ``PROGRESS_HEARTBEAT_S`` while nothing changes
    (a busy 2-core machine may take minutes per file)."""

    def __init__(self, build_dir: Path, sources: list[str]) -> None:
        self.build_dir = build_dir
        self.names = [Path(src).name for src in sources]
        self.start = time.monotonic()
        self.wall_start = time.time() - 1.0  # file mtimes can be a little coarse
        self.done: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-kernels-build", daemon=True)

    def __enter__(self) -> _BuildProgress:
        self._say(
            f"compiling the CPU kernels ({len(self.names)} C++ files from csrc/cpu, once per "
            f"machine; {BUILD_TIME_HINT}) into {self.build_dir}"
        )
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._report_new_files()  # the last one may have landed since the last look
            self._say(f"CPU kernels built in {time.monotonic() - self.start:.0f} s")

    def _say(self, text: str) -> None:
        print(f"glassbox: {text}", file=sys.stderr, flush=True)

    def _finished(self) -> list[str]:
        """Sources whose object file was written by this build."""
        done = []
        for name in self.names:
            try:
                obj = self.build_dir / (Path(name).stem + ".o")
                if obj.stat().st_mtime >= self.wall_start:
                    done.append(name)
            except OSError:
                pass
        return done

    def _report_new_files(self) -> bool:
        elapsed = time.monotonic() - self.start
        new = [name for name in self._finished() if name not in self.done]
        for name in new:
            self.done.append(name)
            self._say(f"  compiled {name} ({len(self.done)}/{len(self.names)}, {elapsed:.0f} s)")
        return bool(new)

    def _run(self) -> None:
        last_news = time.monotonic()
        while not self._stop.wait(PROGRESS_POLL_S):
            if self._report_new_files():
                last_news = time.monotonic()
            elif time.monotonic() - last_news >= PROGRESS_HEARTBEAT_S:
                last_news = time.monotonic()
                self._say(
                    f"  still compiling ({len(self.done)}/{len(self.names)} files done, "
                    f"{last_news - self.start:.0f} s)"
                )


def load(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) ``csrc/cpu/`` and import it.

    A build announces itself and its progress on stderr (``_BuildProgress``);
    ``verbose`` adds the compiler's command lines."""
    missing = [rel for rel in SOURCES + HEADERS if not (CSRC_DIR / rel).is_file()]
    if missing:
        raise FileNotFoundError(f"CPU kernel sources not found under {CSRC_DIR}: {missing}")
    # torch runs `ninja` from PATH; a venv's ninja (pip install ninja) sits beside python.
    if shutil.which("ninja") is None:
        os.environ["PATH"] = (
            os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        )
    build_dir = Path(os.environ.get("GLASSBOX_CACHE") or Path.home() / ".cache" / "glassbox")
    texts = [(CSRC_DIR / rel).read_bytes() for rel in SOURCES + HEADERS]
    build_dir = build_dir / "torch_extensions" / _build_name(texts)
    # Build from copies inside the build folder: ninja rebuilds when a command line
    # changes, and the sources' own paths differ between checkouts of the same code.
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    sources = []
    stale = False
    for rel, text in zip(SOURCES + HEADERS, texts):
        copy = src_dir / Path(rel).name
        if not copy.is_file() or copy.read_bytes() != text:  # rewrite only on change (mtime)
            copy.write_bytes(text)
            stale = True
        if rel in SOURCES:
            sources.append(str(copy))
    built = build_dir / f"{build_dir.name}.so"
    if built.is_file() and not stale:
        # Built before from these very sources: import it directly (cpp_extension.load
        # would rewrite the ninja file and run ninja, ~0.15 s per engine process).
        import torch  # noqa: F401  (loads libtorch/libc10, which the extension links)

        spec = importlib.util.spec_from_file_location(build_dir.name, built)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    from torch.utils import cpp_extension  # slow to import: only when building

    with _BuildProgress(build_dir, sources):
        return cpp_extension.load(
            name=build_dir.name,
            sources=sources,
            # -ffp-contract=off: no fused multiply-adds, so products round as torch's do.
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off"],
            build_directory=str(build_dir),
            verbose=verbose,
        )


if __name__ == "__main__":  # python -m engine._cpu_ops: build now (make setup does)
    module = load(verbose="-v" in sys.argv)
    print(f"CPU kernels ready: {module.__file__}")
