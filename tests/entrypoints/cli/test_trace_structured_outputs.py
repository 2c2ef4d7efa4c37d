"""``glassbox trace --structured-outputs JSON``: the followed prompt is
constrained, the background requests are not, and a bad constraint is one
line on stderr before any model loads."""

from __future__ import annotations

import pytest

from engine.entrypoints.cli import trace
from engine.entrypoints.cli.main import build_parser, main
from engine.sampling_params import StructuredOutputsParams


def _args(*argv: str):
    return build_parser().parse_args(["trace", "What is 2+2?", *argv])


def test_only_the_followed_prompt_is_constrained() -> None:
    args = _args("--structured-outputs", '{"choice": ["4", "5"]}', "--concurrent", "3")
    planned = {r.request_id: r for r in trace.plan_requests(args)}
    so = planned[trace.FOLLOWED_REQUEST_ID].sampling["structured_outputs"]
    assert so == StructuredOutputsParams(choice=["4", "5"])
    assert all(
        "structured_outputs" not in r.sampling
        for rid, r in planned.items()
        if rid != trace.FOLLOWED_REQUEST_ID
    )
    assert "structured_outputs" not in trace.plan_requests(_args())[-1].sampling


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"regex": "a", "choice": ["a"]}', "one kind of constraint"),
        ('{"choice": []}', "structured_outputs.choice must not be an empty list"),
    ],
)
def test_a_bad_constraint_is_one_line(capsys, value, message) -> None:
    assert main(["trace", "Hi", "--headless", "--structured-outputs", value]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
