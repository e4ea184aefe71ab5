"""Launching a Triton kernel without Triton's dispatch at every call.

``kernel[grid](*args, **constexprs)`` binds every argument, works out its
specialization (dtype and 16-byte alignment of each tensor; whether each
int is 1, a multiple of 16, or past int32), builds a cache key from it and
the compile options, and only then launches. For a kernel of some thirty
arguments that costs tens of microseconds of host time. Between the pieces
of an extend's piecewise CUDA graphs attention runs eagerly: four launches a
layer in a mixed step (K/V store, extend, decode split and merge), so on a
32-layer model the dispatch alone was several milliseconds a step, with the
GPU idle (benchmarks/README.md, "Launch cost of the eager attention").

:class:`CachedLaunch` keeps the compiled kernel of each specialization it
has seen, under a key of its own that is at least as fine as Triton's (the
same properties of each argument, and every constexpr and option), and
launches it through the compiled kernel's launcher directly. A new key goes
through Triton's path, which compiles if needed and launches; its compiled
kernel is kept for the next call. Where that is not possible the launch
always takes Triton's path: Triton's interpreter (no compiled kernels), a
launch hook installed (a profiler such as Proton wants to see launches), a
Triton without the launcher interface (no ``run``, ``function`` or
``packed_metadata`` on its compiled kernels), or ``RADIXSERVE_CACHED_LAUNCH=0``
in the environment (for an A/B of the two paths in one run).
"""

from __future__ import annotations

import inspect
import logging
import numbers
import os
import time
from typing import Any, Callable

import torch

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
DISABLE_ENV = "RADIXSERVE_CACHED_LAUNCH"  # "0": every launch through Triton's own path
SLOW_LAUNCH_S = 0.05  # a launch through Triton's path this slow compiled (or loaded) a kernel: logged

logger = logging.getLogger(__name__)


def enabled_by_env() -> bool:
    """Off under Triton's interpreter and with ``RADIXSERVE_CACHED_LAUNCH=0``."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and os.environ.get(DISABLE_ENV, "1") != "0"


def _int_class(n: int) -> int:
    """1; else within int32 or not, times a multiple of 16 or not: Triton
    compiles a kernel per class of each int argument."""
    if n == 1:
        return 1
    return (2 if n % 16 == 0 else 3) if INT32_MIN <= n <= INT32_MAX else (4 if n % 16 == 0 else 5)


def arg_key(arg: Any) -> Any:
    """What Triton specializes a non-constexpr argument on, or something finer:
    a tensor's dtype and whether its address is 16-byte aligned; an int's
    class (:func:`_int_class`); the type of anything else."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if type(arg) is int or (isinstance(arg, numbers.Integral) and not isinstance(arg, bool)):  # numpy's too
        return _int_class(int(arg))
    return type(arg)


def launch_key(args: tuple) -> tuple:
    """The :func:`arg_key` of every argument, with plain tensors and ints
    inline: this runs at every launch, and a call per argument would cost
    more than the rest of the launch."""
    key = []
    append = key.append
    for arg in args:
        kind = type(arg)
        if kind is torch.Tensor:
            append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif kind is int:
            append(1 if arg == 1 else ((2 if arg % 16 == 0 else 3) if INT32_MIN <= arg <= INT32_MAX
                                       else (4 if arg % 16 == 0 else 5)))
        else:
            append(arg_key(arg))
    return tuple(key)


def _hooks_holder() -> Any:
    """Where this Triton keeps its launch enter/exit hooks: ``knobs.runtime``
    in newer Tritons, the ``CompiledKernel`` class in older ones."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return knobs.runtime
    from triton.compiler import CompiledKernel

    return CompiledKernel


def _idle(hook: Any) -> bool:
    """Whether a launch hook does nothing: None (older Tritons) or an empty
    ``HookChain`` (newer ones)."""
    return hook is None or (isinstance(getattr(hook, "calls", None), list) and not hook.calls)


class CachedLaunch:
    """``CachedLaunch(kernel)(grid, *args, **constexprs)`` launches like
    ``kernel[grid](*args, **constexprs)``; see the module docstring. Pass the
    kernel's non-constexpr arguments positionally and its constexprs and
    options (``num_warps``, ``num_stages``) by keyword."""

    def __init__(self, kernel):
        self.kernel = kernel
        # key -> (launcher, function, packed metadata, the constexpr arguments after the positional ones)
        self.compiled: dict[Any, tuple[Callable, Any, Any, tuple]] = {}
        self.enabled = enabled_by_env()
        self.fast_launches = 0  # for tests and benchmarks
        self._device: Callable[[], int] | None = None  # set with the first compiled kernel
        self._stream: Callable[[int], int] | None = None
        self._hooks: Any = None

    def __call__(self, grid: tuple[int, ...], *args, **constexprs) -> None:
        key = None
        if self.enabled and self._device is not None:
            device = self._device()
            key = (device, tuple(constexprs.items()), launch_key(args))
            hit = self.compiled.get(key)
            hooks = self._hooks
            if hit is not None and _idle(hooks.launch_enter_hook) and _idle(hooks.launch_exit_hook):
                run, function, metadata, tail = hit
                run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, self._stream(device),
                    function, metadata, None, None, None, *args, *tail)
                self.fast_launches += 1
                return
        start = time.perf_counter()
        compiled = self.kernel[grid](*args, **constexprs)
        took = time.perf_counter() - start
        if took > SLOW_LAUNCH_S:  # a step that waited on Triton's compiler: say so, it shows in TTFT and ITL
            logger.info("%s: a launch took %.0f ms (a new specialization compiled or loaded from Triton's cache)",
                        getattr(self.kernel, "__name__", self.kernel), took * 1e3)
        if self.enabled:
            self._remember(key, compiled, args, constexprs)

    def _remember(self, key, compiled, args: tuple, constexprs: dict) -> None:
        """Keep ``compiled`` under ``key``, or turn the fast path off for good
        where this Triton's compiled kernels lack the launcher interface."""
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            self.enabled = False
            return
        tail = []
        for param in self.kernel.params[len(args):]:
            if param.name in constexprs:
                tail.append(constexprs[param.name])
            elif param.default is not inspect.Parameter.empty:
                tail.append(param.default)
            else:  # a required argument passed otherwise than expected: leave it to Triton
                self.enabled = False
                return
        if self._device is None:
            self._device, self._stream, self._hooks = self._runtime()
            key = (self._device(), tuple(constexprs.items()), launch_key(args))
        self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata, tuple(tail))

    @staticmethod
    def _runtime() -> tuple[Callable[[], int], Callable[[int], int], Any]:
        """The current device, the raw current stream of a device, and where
        the launch hooks live: the active Triton driver's."""
        from triton.runtime import driver

        return driver.active.get_current_device, driver.active.get_current_stream, _hooks_holder()
