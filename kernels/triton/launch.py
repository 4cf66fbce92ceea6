"""Launching a compiled Triton kernel without Triton's per-call dispatch.

`kernel[grid](*args, **constexprs)` binds and specialises every argument, builds a cache
key (with a `str` of the options), reads Triton's knobs and only then calls the compiled
binary's launcher: 22 us of host time for an empty kernel of 27 arguments on an H100
host (Triton 3.6), against 8 us for torch's `add_` (`benchmarks/launch_probe.py`). A step
that is not replayed from a CUDA graph (prefill and mixed steps, `--eager`, tensor
parallelism) pays it twice per LoRA layer, 448 times per step of a 32-layer model.

`FastLaunch(kernel)(grid, ptrs, scalars, constexprs, **options)` does the first call of
each specialisation through `kernel[grid]`, keeps the compiled kernel it returns, and
later calls the kept binary's launcher straight, as `JITFunction.run` itself does. The
key is finer than Triton's specialisation, so a kept binary is only reused where
Triton would pick the same one: per pointer its dtype and 16-byte alignment; per int
whether it is 1, whether 16 divides it and whether it fits in 32 bits; any other
scalar (a float, a bool) by type and value; the constexprs and launch options by value;
the current device.

It relies on Triton internals (`JITFunction.params`, `CompiledKernel.run / function /
packed_metadata`), so it is on only for the Triton versions it was tested with on a GPU
(TESTED_TRITON, `tests/gpu/test_fast_launch_cuda.py`), and only while no launch hook or
pre-run hook is set (a profiler's); otherwise, and under the CPU interpreter, every call
goes through `kernel[grid]`. LORAFLEET_FAST_LAUNCH=0 turns it off, =1 on for any version.
Knobs changed at run time (TRITON_DEBUG and the like) are not seen by kept binaries.
"""

from __future__ import annotations

import functools
import os

import triton

TESTED_TRITON = ("3.6.",)
_INT32 = range(-(2**31), 2**31)
_MAX_KEPT = 4096


def _mode() -> bool:
    value = os.environ.get("LORAFLEET_FAST_LAUNCH", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"LORAFLEET_FAST_LAUNCH={value!r}; allowed: auto, 0, 1")
    if value == "auto":
        return triton.__version__.startswith(TESTED_TRITON)
    return value == "1"


ENABLED = _mode()
"""Read once at import (tests set the module attribute)."""


_PLANS: list = []


def plan_cache(fn):
    """Memoise a launcher's plan: a pure function of host values (shapes, strides, the
    step's tile height and expected slots, launch configs), the same for every layer of a
    group in one step; planning was about half of an eager layer call's host time
    (launch_probe.py). clear_plans() forgets them all."""
    cached = functools.lru_cache(maxsize=8192)(fn)
    _PLANS.append(cached)
    return cached


def clear_plans() -> None:
    """Forget every memoised plan (tests/conftest.py, around every test: a test may
    patch a planning function or constant)."""
    for cached in _PLANS:
        cached.cache_clear()


def _set(hook) -> bool:
    """A launch hook is set: not None, and not an empty HookChain (Triton 3.6 keeps an
    empty chain, never None, where no profiler has added one)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooked() -> bool:
    runtime = triton.knobs.runtime
    return (
        _set(runtime.launch_enter_hook)
        or _set(runtime.launch_exit_hook)
        or getattr(runtime, "add_stages_inspection_hook", None) is not None
    )


def spec_key(ptrs: tuple, scalars: tuple) -> tuple:
    """What of the runtime arguments Triton specialises on, or finer (module docstring)."""
    return (
        tuple([(t.dtype, not t.data_ptr() & 15) for t in ptrs]),
        tuple(
            [(v == 1, not v & 15, v in _INT32) if type(v) is int else (type(v), v) for v in scalars]
        ),
    )


class FastLaunch:
    """A @triton.jit kernel whose runtime arguments are all pointers, then all scalars,
    then its constexprs (in the signature's order); see the module docstring."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.constexprs: tuple[str, ...] = ()
        self.arity = len(params or ())
        self.usable = False
        if isinstance(kernel, triton.runtime.jit.JITFunction) and params is not None:
            flags = [p.is_constexpr for p in params]
            runtime = flags.index(True) if True in flags else len(flags)
            self.constexprs = tuple(p.name for p in params[runtime:])
            self.usable = all(flags[runtime:])
        self.kept: dict[tuple, object] = {}
        self.fast_calls = 0

    def __call__(self, grid, ptrs: tuple, scalars: tuple, constexprs: dict, **options) -> None:
        if not (ENABLED and self.usable) or self.kernel.pre_run_hooks or _hooked():
            self.kernel[grid](*ptrs, *scalars, **constexprs, **options)
            return
        device = triton.runtime.driver.active.get_current_device()
        key = (device, spec_key(ptrs, scalars), tuple(constexprs.values()), tuple(options.items()))
        compiled = self.kept.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*ptrs, *scalars, **constexprs, **options)
            whole = len(ptrs) + len(scalars) + len(constexprs) == self.arity
            if (
                whole
                and tuple(constexprs) == self.constexprs
                and hasattr(compiled, "packed_metadata")
            ):
                if len(self.kept) >= _MAX_KEPT:
                    self.kept.clear()
                self.kept[key] = compiled
            return
        stream = triton.runtime.driver.active.get_current_stream(device)
        g0, g1, g2 = (*grid, 1, 1)[:3]
        compiled.run(
            g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
            *ptrs, *scalars, *constexprs.values(),
        )  # fmt: skip
        self.fast_calls += 1
