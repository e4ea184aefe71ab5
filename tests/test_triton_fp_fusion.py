"""Importing radixserve makes Triton's FMA contraction explicit (on, as our
kernels were tuned), so Triton 3.10's new default does not change their
numerics, and keeps a user's own TRITON_DEFAULT_FP_FUSION."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

knobs = pytest.importorskip("triton.knobs")
if not hasattr(getattr(knobs, "language", None), "fp_fusion_enabled"):
    pytest.skip("this Triton has no TRITON_DEFAULT_FP_FUSION knob", allow_module_level=True)

PROBE = ("import warnings; warnings.simplefilter('error'); import radixserve, triton.knobs as k; "
         "print(k.language.fp_fusion_enabled(None))")  # Triton warns when the variable is unset


@pytest.mark.parametrize("setting, enabled", [(None, "True"), ("0", "False"), ("1", "True")])
def test_fp_fusion_default(setting, enabled):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if setting is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == enabled
