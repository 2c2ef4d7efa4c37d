"""vLLM's hardware-dependent defaults on a real GPU.

``EngineArgs.get_batch_defaults`` reads the GPU's memory and name through NVML
(``DeviceConfig.get_device_total_memory`` / ``get_device_name``) so that the
front end creates no CUDA context. On the CPU the NVML path is only faked
(tests/test_config.py); here it meets the driver: NVML must agree with torch
about the first visible GPU, the front end must stay without a CUDA context,
and the batch limits must be the ones vLLM picks for that memory.

Marked ``gpu``: skipped where torch sees no CUDA device (CI).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

GiB = 1 << 30

# Run in a child: this test process may already hold a CUDA context.
PROBE = textwrap.dedent(
    """
    import json, torch
    from engine.config import DeviceConfig
    from engine.engine.arg_utils import EngineArgs
    from engine.usage.usage_lib import UsageContext as U

    cuda = DeviceConfig(device="cuda")
    memory, name = cuda.get_device_total_memory(), cuda.get_device_name()
    tokens, seqs = EngineArgs.get_batch_defaults(1, cuda)
    no_context = not torch.cuda.is_initialized()
    props = torch.cuda.get_device_properties(0)
    print(json.dumps({
        "memory": memory, "name": name, "no_context": no_context,
        "torch_memory": props.total_memory, "torch_name": props.name,
        "llm": [tokens[U.LLM_CLASS], seqs[U.LLM_CLASS]],
        "serve": [tokens[U.OPENAI_API_SERVER], seqs[U.OPENAI_API_SERVER]],
    }))
    """
)


def test_nvml_agrees_with_torch_and_picks_vllms_batch_limits():
    import json

    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["no_context"], "asking NVML created a CUDA context in the front end"
    assert facts["name"] == facts["torch_name"]
    # NVML counts every byte; torch's total leaves out what the driver reserves.
    assert 0.9 * facts["memory"] <= facts["torch_memory"] <= facts["memory"]
    big = facts["memory"] >= 70 * GiB and "a100" not in facts["name"].lower()
    assert facts["llm"] == ([16384, 1024] if big else [8192, 256])
    assert facts["serve"] == ([8192, 1024] if big else [2048, 256])
