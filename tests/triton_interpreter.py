"""Running a script under Triton's interpreter (``TRITON_INTERPRET=1``) in a
process of its own: the flag is read when kernels are defined, so it cannot
be turned on inside the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_interpreted(script: str, payload) -> dict:
    """Run ``script`` with ``payload`` as JSON in ``sys.argv[1]``; returns the
    JSON object its last line of output prints."""
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(payload)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
