"""Schema fuzzing of the API server with schemathesis (issue 17, point 7).

Every operation of ``/openapi.json`` gets schemathesis-generated requests --
valid bodies and, in negative mode, bodies that break the schema -- against a
real server (the tiny model, ``CountingExecutor``), and each answer is checked
against the schema: no 5xx, only declared status codes and content types,
bodies that match their schemas, schema-breaking input refused with a 4xx.

The normal suite runs a small budget (a few seconds); the full run sets
``GLASSBOX_SCHEMATHESIS_MAX_EXAMPLES`` (examples per operation) and adds
schemathesis' coverage phase (edge values of every field)::

    GLASSBOX_SCHEMATHESIS_MAX_EXAMPLES=500 .venv/bin/python -m pytest -q \\
        tests/reliability/test_schemathesis.py

Excluded check, with its reason (docs/reliability.md, "Schema fuzzing"):
``positive_data_acceptance`` -- the schema gives each field its type, not
every rule the server applies (``temperature >= 0``, ``max_tokens`` within the
context, a known ``model`` name, ...), so a schema-valid body may rightly get
400/404.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.entrypoints.openai.utils import COUNTING_EXECUTOR, RemoteOpenAIServer
from tests.helpers.tiny_model import make_tiny_model_dir

FULL_RUN = "GLASSBOX_SCHEMATHESIS_MAX_EXAMPLES" in os.environ
MAX_EXAMPLES = int(os.environ.get("GLASSBOX_SCHEMATHESIS_MAX_EXAMPLES", "4"))
KEY = "fuzz"
FLAGS = [
    "--distributed-executor-backend",
    COUNTING_EXECUTOR,
    "--block-size",
    "4",
    "--max-model-len",
    "64",
    "--api-key",
    KEY,
    "--served-model-name",
    "tiny",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model_dir(tmp_path_factory.mktemp("fuzz") / "tiny")
    with RemoteOpenAIServer(model, FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url_for("openapi.json"))
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=MAX_EXAMPLES
    )
    # The coverage phase (schema edge cases, ~1,000 requests) only in the full run.
    phases = ["examples", "coverage", "fuzzing"] if FULL_RUN else ["examples", "fuzzing"]
    schema.config.phases.update(phases=phases)
    return schema


@pytest.fixture(scope="module")
def session():
    with requests.Session() as session:
        yield session


# Requests sent and answers got, per operation: the full run prints them.
CASES: collections.Counter[str] = collections.Counter()
STATUSES: collections.Counter[str] = collections.Counter()


def _report_counts() -> None:
    print(
        f"schemathesis: {sum(CASES.values())} cases; per operation {dict(CASES)}; "
        f"statuses {dict(sorted(STATUSES.items()))}",
        file=sys.__stderr__,
    )


if FULL_RUN:
    # At exit, once pytest no longer captures the output.
    atexit.register(_report_counts)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_api_conforms_to_its_schema(case, server, session):
    CASES[f"{case.method} {case.path}"] += 1
    response = case.call_and_validate(
        base_url=server.url_root,
        session=session,
        headers={"Authorization": f"Bearer {KEY}"},
        excluded_checks=[positive_data_acceptance],
        timeout=60,
    )
    STATUSES[str(response.status_code)] += 1
