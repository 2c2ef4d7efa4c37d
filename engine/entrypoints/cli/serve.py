"""``glassbox serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]``.

vLLM twin: ``vllm/entrypoints/cli/serve.py`` (``ServeSubcommand``).
Starts the OpenAI-compatible server of ``engine/entrypoints/openai/api_server.py``:
the listening socket is bound first (a busy port fails before any model is
loaded), then EngineCore starts in its own process, then uvicorn serves until
Ctrl-C, and the engine process is stopped on the way out. Binds to 127.0.0.1
unless ``--host`` says otherwise.
Sessions: 01.

Differs from vLLM on purpose: a bad engine argument or model name (a
``ValueError`` while the engine config is built) ends the command with one
line on stderr and exit code 2, where ``vllm serve`` shows a traceback: the
message already names the field or the model, and a new user reads one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

HELP = "Start the OpenAI-compatible API server (FastAPI + uvicorn)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.entrypoints.openai.cli_args import make_arg_parser

    make_arg_parser(parser)


def run(args: argparse.Namespace) -> int:
    from engine.entrypoints.openai.api_server import create_server_socket, run_server
    from engine.entrypoints.openai.cli_args import validate_parsed_serve_args

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        validate_parsed_serve_args(args)
    except ValueError as e:
        print(f"glassbox serve: error: {e}", file=sys.stderr)
        return 2
    try:
        sock = create_server_socket(args.host, args.port)
    except OSError as e:
        print(
            f"glassbox serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr
        )
        return 1
    try:
        asyncio.run(run_server(args, sock))
    except KeyboardInterrupt:
        pass
    except ValueError as e:
        # A bad engine argument or model name, found while building the config:
        # one line, as for the flags checked above.
        print(f"glassbox serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        sock.close()
    return 0
