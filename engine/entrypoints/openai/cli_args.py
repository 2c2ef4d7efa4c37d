"""Command-line arguments of ``glassbox serve``.

vLLM twin: ``vllm/entrypoints/openai/cli_args.py`` (``make_arg_parser``,
``FrontendArgs``) plus ``EngineArgs.add_cli_args`` from
``vllm/engine/arg_utils.py``.
Read it for the split: server options (``--host``, ``--port``, ``--api-key``,
``--served-model-name``, the HTTP limits of ``add_http_limit_args``) and,
generated from the ``EngineArgs`` dataclass, one ``--kebab-case`` flag per
engine argument (``--block-size``, ``--max-num-seqs``,
``--num-gpu-blocks-override``, ...), so every keyword
``LLM(...)`` takes is a flag here too. As in vLLM, each flag's help is the
docstring under its field (``get_attr_docs``) and ``--help`` shows every
default (``DefaultsHelpFormatter``).
Sessions: 01.

Simpler than vLLM: the help comes from ``EngineArgs``' own field docstrings
(a field without one falls back on the same-named field of a config class);
vLLM's ``EngineArgs`` fields take theirs from the config classes they mirror.

Differs from vLLM on purpose: ``--host`` defaults to 127.0.0.1, where vLLM
binds every interface; a server started on a learner's laptop is not
reachable from the network unless ``--host 0.0.0.0`` asks for it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import json
import os
import textwrap
import types
import typing
from functools import cache
from typing import Any

from engine.engine.arg_utils import EngineArgs
from engine.utils.argparse_utils import human_readable_int, max_model_len, optimization_level

# Engine arguments that take vLLM's human-readable integers (32k, 4G).
_HUMAN_READABLE = {
    "max_num_batched_tokens": human_readable_int,
    "kv_cache_memory_bytes": human_readable_int,
    "max_model_len": max_model_len,
}

API_KEY_ENV = "GLASSBOX_API_KEY"


def _flag_type(annotation: Any) -> Any:
    """The argparse ``type`` for an EngineArgs field annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if type in non_none or any(typing.get_origin(a) is type for a in non_none):
            return str  # distributed_executor_backend: a name or a class path
        return _flag_type(non_none[0])
    if annotation is bool:
        return bool
    if annotation in (int, float, str):
        return annotation
    if typing.get_origin(annotation) is dict or annotation is dict:
        return json.loads
    return str


def _is_list(annotation: Any) -> bool:
    options = (
        typing.get_args(annotation)
        if typing.get_origin(annotation)
        in (
            typing.Union,
            types.UnionType,
        )
        else (annotation,)
    )
    return any(typing.get_origin(a) is list for a in options)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with ``(default: ...)``, as in ``vllm serve --help``,
    unless its text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "(default" in action.help:
            return action.help
        return super()._get_help_string(action)


def get_attr_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for the string literals placed right under a
    class's field assignments (the convention of vLLM's config classes)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source shipped: no help text, flags still work
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


@cache
def engine_arg_help() -> dict[str, str]:
    """One line of ``--help`` per EngineArgs field: the first paragraph of its
    docstring, else of the same-named field's docstring in a config class."""
    from engine import config

    docs: dict[str, str] = {}
    for name in config.__all__:
        cls = getattr(config, name)
        if dataclasses.is_dataclass(cls):
            docs.update(get_attr_docs(cls))
    docs.update(get_attr_docs(EngineArgs))
    # argparse expands %-formats in help text.
    return {k: " ".join(v.split("\n\n")[0].split()).replace("%", "%%") for k, v in docs.items()}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine arguments (the fields of EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    docs = engine_arg_help()
    for field in dataclasses.fields(EngineArgs):
        if field.name == "model":
            continue  # the positional MODEL (or --model below)
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(hints[field.name])
        kwargs: dict[str, Any] = {"default": field.default, "help": docs.get(field.name)}
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif field.name == "optimization_level":
            # vLLM's spellings: -O3, -O 3, -O=3, --optimization-level 3.
            group.add_argument(flag, "-O", type=optimization_level, metavar="{0,1,2,3}", **kwargs)
        elif field.name == "tensor_parallel_size":
            group.add_argument(flag, "-tp", type=kind, **kwargs)  # vLLM's short form
        elif field.name in _HUMAN_READABLE:
            group.add_argument(flag, type=_HUMAN_READABLE[field.name], **kwargs)
        elif _is_list(hints[field.name]):
            # logits_processors: one or more "module:Class" names.
            group.add_argument(flag, nargs="+", **kwargs)
        else:
            group.add_argument(flag, type=kind, **kwargs)
    group.add_argument(
        "--model", dest="model", default=None, help="the same as the positional MODEL"
    )


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF checkpoint folder, or a Hub name already in the Hugging Face cache "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (vLLM binds every interface; 0.0.0.0 does that here)",
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set {API_KEY_ENV})",
    )
    parser.add_argument("--response-role", default="assistant", help="role of chat replies")
    parser.add_argument("--enable-log-requests", action="store_true", help="log every request")
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn (the HTTP server)",
    )
    parser.add_argument(
        "--keep-alive-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep serving (every request gets 503, /health reports 503) after EngineCore "
        "dies; --no-keep-alive-on-engine-death stops the server, as vLLM does by default",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served under their own model names: name=path, or a JSON "
        'object {"name": ..., "path": ..., "base_model_name": ...} (needs --enable-lora)',
    )
    add_http_limit_args(parser)
    add_engine_args(parser)
    # A server lets the streams in flight finish on SIGTERM (vLLM's default: 0).
    parser.set_defaults(shutdown_timeout=SERVE_SHUTDOWN_TIMEOUT_DEFAULT)
    return parser


SERVE_SHUTDOWN_TIMEOUT_DEFAULT = 30


# What one client may send (issue 17); each default is far above what a normal
# request needs. vLLM has the two --h11-* flags (its defaults: 4 MiB, 256).
MAX_REQUEST_BODY_SIZE_DEFAULT = 8 * 1024 * 1024
H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT = 64 * 1024
H11_MAX_HEADER_COUNT_DEFAULT = 256
LIMIT_CONCURRENCY_DEFAULT = 1024
HEADER_READ_TIMEOUT_DEFAULT = 20.0
BODY_READ_TIMEOUT_DEFAULT = 60.0


def add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP limits (what one client may send)")
    group.add_argument(
        "--max-request-body-size",
        type=int,
        default=MAX_REQUEST_BODY_SIZE_DEFAULT,
        help="largest request body in bytes; a larger one gets 413 before it is parsed",
    )
    group.add_argument(
        "--max-input-chars",
        type=int,
        default=None,
        help="most characters a prompt (or the messages) may have; a longer one gets 400 "
        "before tokenizing (default: none beyond vLLM's own bound, max_model_len times the "
        "longest token in the vocabulary)",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT,
        help="largest request head (request line + headers) in bytes; a larger one gets 431",
    )
    group.add_argument(
        "--h11-max-header-count",
        type=int,
        default=H11_MAX_HEADER_COUNT_DEFAULT,
        help="most headers a request may have; more get 431",
    )
    group.add_argument(
        "--limit-concurrency",
        type=int,
        default=LIMIT_CONCURRENCY_DEFAULT,
        help="most open connections (or requests in progress); beyond it a request gets 503",
    )
    group.add_argument(
        "--header-read-timeout",
        type=float,
        default=HEADER_READ_TIMEOUT_DEFAULT,
        help="seconds a client has to send a request's headers (from connecting, or from the "
        "end of its previous response); then 408 and the connection closes",
    )
    group.add_argument(
        "--body-read-timeout",
        type=float,
        default=BODY_READ_TIMEOUT_DEFAULT,
        help="seconds a client has to send a request's body once its headers are in; then 408",
    )


def resolve_executor_backend(value: Any) -> Any:
    """``module.Class`` (or ``module:Class``) -> the class; a backend name unchanged."""
    if not isinstance(value, str) or value in ("uni", "mp", "ray"):
        return value
    module_name, sep, class_name = value.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(
            "distributed_executor_backend must be 'uni', 'mp', 'ray' or an importable class path "
            f"such as 'my_pkg.my_module.MyExecutor', got {value!r}"
        )
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"distributed_executor_backend {value!r} cannot be imported: {e}") from e


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    kwargs = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"
    }
    kwargs["distributed_executor_backend"] = resolve_executor_backend(
        kwargs["distributed_executor_backend"]
    )
    return EngineArgs(model=args.model_tag or args.model, **kwargs)


def api_keys(args: argparse.Namespace) -> list[str]:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return [key] if key else []


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for name in (
        "max_request_body_size",
        "max_input_chars",
        "h11_max_incomplete_event_size",
        "h11_max_header_count",
        "limit_concurrency",
        "header_read_timeout",
        "body_read_timeout",
    ):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.lora_modules:
        if not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        from engine.entrypoints.openai.models.serving import LoRAModulePath

        for module in args.lora_modules:
            LoRAModulePath.parse(module)
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
