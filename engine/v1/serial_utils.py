"""msgpack encoding of the messages that cross the ZMQ hop.

vLLM twin: ``vllm/v1/serial_utils.py`` (``MsgpackEncoder``, ``MsgpackDecoder``).
Read it for the zero-copy trick: an array inside a message is not copied into
the msgpack buffer. ``encode()`` returns ``[main_buffer, *aux_buffers]``; a
large array is written as ``(dtype, shape, index)`` where ``index`` points at
its own raw buffer in that list, and the list goes out as the frames of one
``send_multipart``. Small arrays travel inline as a raw-bytes msgpack
extension. ``MsgpackDecoder.decode(frames)`` rebuilds arrays as views on the
received frames.
Sessions: 01 (engine loop across two processes).

Simpler than vLLM: numpy arrays and CPU torch tensors only (no multimodal
items, no out-of-band tensor queues), and no pickle fallback -- an object
msgpack cannot express is a ``TypeError`` naming its type, because the only
things that cross Glassbox's hop are its own msgspec structs. Like vLLM's, an
encoder or decoder object is not thread-safe; each IO thread owns its own.

One opt-in exception: ``collective_rpc`` / ``apply_model`` from the front end
send a function to the workers, and that call and its result travel pickled
(as msgpack bytes) only when ``GLASSBOX_ALLOW_INSECURE_SERIALIZATION=1``
(vLLM's ``VLLM_ALLOW_INSECURE_SERIALIZATION``): unpickling runs code, so a
process must not accept pickles unless its user said so.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Sequence
from inspect import isclass
from typing import Any

import numpy as np
import zmq
from msgspec import msgpack

# msgpack extension code for "these bytes are an array's raw data".
CUSTOM_TYPE_RAW_VIEW = 3

# Arrays at least this large go out as their own frame instead of inline.
DEFAULT_SIZE_THRESHOLD = 256

bytestr = bytes | bytearray | memoryview | zmq.Frame


def _torch_tensor_type() -> type | None:
    # Only look at torch if something already imported it: the front end of a
    # CountingExecutor engine never needs to pay for importing torch.
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


class MsgpackEncoder:
    def __init__(self, size_threshold: int = DEFAULT_SIZE_THRESHOLD) -> None:
        if not isinstance(size_threshold, int) or size_threshold < 0:
            raise ValueError(f"size_threshold must be an integer >= 0, got {size_threshold!r}")
        self.encoder = msgpack.Encoder(enc_hook=self.enc_hook)
        self.size_threshold = size_threshold
        # Frames collected while one encode() runs (enc_hook appends to it).
        self.aux_buffers: list[bytestr] | None = None

    def encode(self, obj: Any) -> Sequence[bytestr]:
        """``[msgpack bytes, *array buffers]``: send them as one multipart message."""
        try:
            self.aux_buffers = bufs = [b""]
            bufs[0] = self.encoder.encode(obj)
            return bufs
        finally:
            self.aux_buffers = None

    def encode_into(self, obj: Any, buf: bytearray) -> Sequence[bytestr]:
        """Like ``encode`` but writes the main buffer into ``buf`` (reused
        between sends by the core's output thread)."""
        try:
            self.aux_buffers = bufs = [buf]
            self.encoder.encode_into(obj, buf)
            return bufs
        finally:
            self.aux_buffers = None

    def enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray) and obj.dtype.kind not in ("O", "V"):
            return self._encode_ndarray(obj)
        tensor_type = _torch_tensor_type()
        if tensor_type is not None and isinstance(obj, tensor_type):
            if obj.device.type != "cpu":
                raise TypeError(
                    f"only CPU tensors can be serialised, got one on {obj.device}; "
                    "move it with .cpu() first"
                )
            torch = sys.modules["torch"]
            # Any dtype (bfloat16 too) as its raw bytes.
            raw = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            _, _, data = self._encode_ndarray(raw)
            return str(obj.dtype).removeprefix("torch."), tuple(obj.shape), data
        raise TypeError(
            f"objects of type {type(obj).__name__} cannot cross the engine-core hop: "
            "only msgspec structs, msgpack-native values, numpy arrays and CPU "
            "tensors are serialisable"
        )

    def _encode_ndarray(self, arr: np.ndarray) -> tuple[str, tuple[int, ...], Any]:
        assert self.aux_buffers is not None, "enc_hook called outside encode()"
        data = arr.data if arr.flags.c_contiguous else arr.tobytes()
        if not arr.shape or arr.nbytes < self.size_threshold:
            payload: Any = msgpack.Ext(CUSTOM_TYPE_RAW_VIEW, data)
        else:
            payload = len(self.aux_buffers)  # index of the frame holding the bytes
            self.aux_buffers.append(data)
        return arr.dtype.str, arr.shape, payload


class MsgpackDecoder:
    def __init__(self, t: Any | None = None) -> None:
        args = () if t is None else (t,)
        self.decoder = msgpack.Decoder(*args, ext_hook=self.ext_hook, dec_hook=self.dec_hook)
        self.aux_buffers: Sequence[bytestr] = ()

    def decode(self, bufs: bytestr | Sequence[bytestr]) -> Any:
        if isinstance(bufs, (bytes, bytearray, memoryview, zmq.Frame)):
            return self.decoder.decode(_as_buffer(bufs))
        self.aux_buffers = bufs
        try:
            return self.decoder.decode(_as_buffer(bufs[0]))
        finally:
            self.aux_buffers = ()

    def dec_hook(self, t: type, obj: Any) -> Any:
        if isclass(t) and issubclass(t, np.ndarray):
            return self._decode_ndarray(obj)
        tensor_type = _torch_tensor_type()
        if tensor_type is not None and isclass(t) and issubclass(t, tensor_type):
            import torch

            dtype, shape, data = obj
            raw = self._decode_ndarray(("|u1", (-1,), data))
            if raw.size == 0:
                return torch.empty(shape, dtype=getattr(torch, dtype))
            return torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).view(shape)
        return obj

    def _decode_ndarray(self, obj: Any) -> np.ndarray:
        dtype, shape, data = obj
        buffer = _as_buffer(self.aux_buffers[data]) if isinstance(data, int) else data
        # A view on the received frame: no copy.
        return np.frombuffer(buffer, dtype=dtype).reshape(shape)

    @staticmethod
    def ext_hook(code: int, data: memoryview) -> Any:
        if code == CUSTOM_TYPE_RAW_VIEW:
            return data
        raise NotImplementedError(f"unknown msgpack extension type code {code}")


def _as_buffer(buf: bytestr) -> bytes | bytearray | memoryview:
    return buf.buffer if isinstance(buf, zmq.Frame) else buf


ALLOW_INSECURE_SERIALIZATION_ENV = "GLASSBOX_ALLOW_INSECURE_SERIALIZATION"


def check_insecure_serialization(what: str) -> None:
    """ValueError unless the user allowed pickles across the process hop."""
    if os.environ.get(ALLOW_INSECURE_SERIALIZATION_ENV, "").lower() not in ("1", "true"):
        raise ValueError(
            f"{what} sends its call to the EngineCore process pickled: set "
            f"{ALLOW_INSECURE_SERIALIZATION_ENV}=1 before the engine starts (vLLM: "
            "VLLM_ALLOW_INSECURE_SERIALIZATION) or run EngineCore in this process "
            "(GLASSBOX_ENABLE_MULTIPROCESSING=0)"
        )


def pickle_call(value: Any, what: str) -> bytes:
    """``value`` pickled for the hop (after ``check_insecure_serialization``)."""
    check_insecure_serialization(what)
    try:
        return pickle.dumps(value, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(
            f"{what} cannot send its arguments to the EngineCore process ({e}); pass a "
            "top-level function of an importable module"
        ) from e


def unpickle_call(payload: bytes, what: str) -> Any:
    check_insecure_serialization(what)
    return pickle.loads(payload)
