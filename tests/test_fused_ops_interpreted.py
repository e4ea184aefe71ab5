"""A few cases of the fused kernels' tests (``test_fused_ops.py``, which
needs a GPU) run in Triton's interpreter, so that CI runs the kernels too:
small shapes only, the interpreter being slow. The flag is read when the
kernels are defined, so the tests run in a pytest process of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CASES = [
    "test_qk_norm_and_rotary_in_one_launch[7-64-dtype2]",  # float32
    "test_qk_norm_and_rotary_in_one_launch[7-128-dtype0]",  # bfloat16
    "test_qk_norm_and_rotary_in_one_launch[0-64-dtype0]",
    "test_rotary_embedding[7-64-12-2-dtype2]",
    "test_qk_norm_over_strided_heads[7-64-dtype2]",
    "test_layers_dispatch_to_the_kernels",
]


def test_fused_kernels_in_the_interpreter():
    here = os.path.dirname(__file__)
    nodes = [f"{os.path.join(here, 'test_fused_ops.py')}::{case}" for case in CASES]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodes],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert f"{len(CASES)} passed" in proc.stdout
