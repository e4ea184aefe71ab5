"""CachedLaunch (triton_ops/launch.py) over a stand-in kernel, on any machine:
which launches reuse a compiled kernel and what they pass to its launcher.
The GPU test in test_triton_backend.py checks its launches against Triton's."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radixserve.layers.attention.triton_ops.launch import CachedLaunch, arg_key, launch_key

STREAM = 77


class Compiled:
    """What Triton's launch returns: a compiled kernel and its launcher."""

    def __init__(self, log: list, number: int):
        self.log, self.function, self.packed_metadata = log, f"function {number}", f"metadata {number}"

    def run(self, *launch_args):
        self.log.append(("fast", launch_args))


class Kernel:
    """A stand-in for a ``@triton.jit`` function of signature
    ``(x, n, scale, BLOCK: constexpr, FLAG: constexpr = False)``."""

    params = [SimpleNamespace(name=name, default=default) for name, default in (
        ("x", inspect.Parameter.empty), ("n", inspect.Parameter.empty), ("scale", inspect.Parameter.empty),
        ("BLOCK", inspect.Parameter.empty), ("FLAG", False))]

    def __init__(self, compiled_cls=Compiled):
        self.log, self.compiled_cls = [], compiled_cls

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.log.append(("triton", grid, args, constexprs))
            return self.compiled_cls(self.log, len(self.log))
        return launch


@pytest.fixture
def hooks(monkeypatch):
    """The runtime CachedLaunch reads: device 0, a fixed stream, no hooks."""
    holder = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(CachedLaunch, "_runtime", staticmethod(lambda: (lambda: 0, lambda device: STREAM, holder)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RADIXSERVE_CACHED_LAUNCH", raising=False)
    return holder


def kinds(kernel: Kernel) -> list[str]:
    return [entry[0] for entry in kernel.log]


def test_a_seen_specialization_launches_its_compiled_kernel(hooks):
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    x, y = torch.zeros(64), torch.ones(64)
    launch((3, 2), x, 32, 0.5, BLOCK=16, num_warps=4)
    launch((5,), y, 48, 0.25, BLOCK=16, num_warps=4)  # other values, same specialization
    assert kinds(kernel) == ["triton", "fast"]
    # grid padded to three axes, the stream, the compiled kernel, no launch metadata or hooks, then every
    # argument in the kernel's order: the positional ones, the constexprs, the defaults
    assert kernel.log[1][1] == (5, 1, 1, STREAM, "function 1", "metadata 1", None, None, None, y, 48, 0.25, 16, False)
    assert launch.fast_launches == 1


@pytest.mark.parametrize("change", ["n is 1", "n not a multiple of 16", "n past int32", "unaligned tensor",
                                    "dtype", "constexpr", "option"])
def test_another_specialization_goes_through_triton(hooks, change):
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    x = torch.zeros(64)
    base = dict(x=x, n=32, block=16, warps=4)
    other = dict(base, **{"n is 1": {"n": 1}, "n not a multiple of 16": {"n": 33}, "n past int32": {"n": 2**32},
                          "unaligned tensor": {"x": x[1:]}, "dtype": {"x": x.half()}, "constexpr": {"block": 32},
                          "option": {"warps": 8}}[change])
    for case in (base, other, other, base):
        launch((1,), case["x"], case["n"], 1.0, BLOCK=case["block"], num_warps=case["warps"])
    assert kinds(kernel) == ["triton", "triton", "fast", "fast"]
    assert [entry[1][4] for entry in kernel.log[2:]] == ["function 2", "function 1"]  # each its own kernel


def test_arg_key_follows_tritons_specialization():
    assert arg_key(1) != arg_key(17) != arg_key(16) != arg_key(2**40 * 16)
    assert arg_key(32) == arg_key(48) and arg_key(3) == arg_key(5)
    assert arg_key(1.0) == arg_key(2.5) and arg_key(True) != arg_key(1)
    assert arg_key(np.int64(1)) == arg_key(1) and arg_key(np.int64(17)) == arg_key(17) != arg_key(np.int64(32))
    t = torch.zeros(8, dtype=torch.float16)
    assert arg_key(t) == arg_key(torch.ones(4, dtype=torch.float16)) != arg_key(t[1:])
    args = (t, t[1:], torch.nn.Parameter(torch.zeros(4)), 1, 16, 17, 2**40, 2**40 + 1, -16, 0.5, True, None, np.int32(48))
    assert launch_key(args) == tuple(map(arg_key, args))  # the inline paths agree with arg_key
    assert len(set(launch_key(args)[3:8])) == 5  # every class of int apart


def test_a_launch_hook_sends_launches_through_triton(hooks):
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    x = torch.zeros(64)
    launch((1,), x, 32, 1.0, BLOCK=16)
    hooks.launch_enter_hook = SimpleNamespace(calls=[print])  # a profiler's hook chain
    launch((1,), x, 32, 1.0, BLOCK=16)
    hooks.launch_enter_hook = SimpleNamespace(calls=[])  # an empty chain does nothing
    launch((1,), x, 32, 1.0, BLOCK=16)
    assert kinds(kernel) == ["triton", "triton", "fast"]


def test_without_a_launcher_interface_every_launch_goes_through_triton(hooks):
    kernel = Kernel(compiled_cls=lambda log, number: None)  # e.g. the interpreter returns nothing
    launch = CachedLaunch(kernel)
    for _ in range(3):
        launch((1,), torch.zeros(64), 32, 1.0, BLOCK=16)
    assert kinds(kernel) == ["triton"] * 3 and not launch.enabled and not launch.compiled


def test_a_missing_required_argument_leaves_launches_to_triton(hooks):
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    for _ in range(2):
        launch((1,), torch.zeros(64), 32, 1.0)  # BLOCK neither passed nor defaulted: Triton's to report
    assert kinds(kernel) == ["triton"] * 2 and not launch.enabled


@pytest.mark.parametrize("env", ["TRITON_INTERPRET=1", "RADIXSERVE_CACHED_LAUNCH=0"])
def test_the_environment_can_send_every_launch_through_triton(hooks, monkeypatch, env):
    monkeypatch.setenv(*env.split("="))
    kernel = Kernel()
    launch = CachedLaunch(kernel)
    for _ in range(2):
        launch((1,), torch.zeros(64), 32, 1.0, BLOCK=16)
    assert kinds(kernel) == ["triton"] * 2


def test_a_slow_launch_through_triton_is_logged(hooks, monkeypatch, caplog):
    """A launch that waited on Triton's compiler shows in the log (it shows in a step's time)."""
    from radixserve.layers.attention.triton_ops import launch as launch_module

    kernel = Kernel()
    launch = CachedLaunch(kernel)
    x = torch.zeros(64)
    with caplog.at_level("INFO", logger=launch_module.__name__):
        monkeypatch.setattr(launch_module, "SLOW_LAUNCH_S", float("inf"))
        launch((1,), x, 32, 0.5, BLOCK=16)
        assert not caplog.records
        monkeypatch.setattr(launch_module, "SLOW_LAUNCH_S", -1.0)
        launch((1,), x, 32, 0.5, BLOCK=32)  # a new specialization: through Triton
        launch((1,), x, 32, 0.5, BLOCK=32)  # its compiled kernel: never logged
    assert kinds(kernel) == ["triton", "triton", "fast"]
    assert len(caplog.records) == 1 and "a new specialization" in caplog.records[0].getMessage()
