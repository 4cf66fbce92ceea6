"""kernels/triton/launch.py, pure logic: its key tells apart what Triton specialises on,
its switch, and the interpreter's fall-through (the launches themselves: tests/gpu)."""

import pytest
import torch

import kernels.triton.launch as launch
import kernels.triton.lora_shrink as shrink_mod


def _key(ptrs=(), scalars=()):
    return launch.spec_key(tuple(ptrs), tuple(scalars))


def test_pointers_by_dtype_and_16_byte_alignment():
    base = torch.zeros(64, dtype=torch.float16)
    assert base.data_ptr() % 16 == 0
    assert _key([base]) == _key([torch.zeros(8, dtype=torch.float16)])
    assert _key([base]) != _key([base[1:]])  # 2 bytes in: not 16-byte aligned
    assert _key([base]) == _key([base[8:]])  # 16 bytes in
    assert _key([base]) != _key([base.view(torch.bfloat16)])


@pytest.mark.parametrize(
    ("a", "b"),
    [(1, 17), (16, 32 + 1), (16, 2**31), (2**31 - 16, 2**31), (-16, -(2**31) - 16), (0, 3)],
)
def test_ints_that_triton_could_specialise_apart_get_apart(a, b):
    assert _key(scalars=[a]) != _key(scalars=[b])


def test_ints_alike_share_a_key_other_scalars_go_by_type_and_value():
    assert _key(scalars=[16, 3]) == _key(scalars=[4096, 5])
    assert _key(scalars=[0.5]) != _key(scalars=[1.0])
    assert _key(scalars=[True]) != _key(scalars=[1])  # Triton: u1 against i32
    assert _key(scalars=[1.0]) != _key(scalars=[1])


@pytest.mark.parametrize(("value", "on"), [("0", False), ("1", True)])
def test_switch(monkeypatch, value, on):
    monkeypatch.setenv("LORAFLEET_FAST_LAUNCH", value)
    assert launch._mode() is on


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("LORAFLEET_FAST_LAUNCH", "yes")
    with pytest.raises(ValueError, match="LORAFLEET_FAST_LAUNCH='yes'; allowed: auto, 0, 1"):
        launch._mode()


def test_the_interpreter_never_keeps_a_binary():
    """Under TRITON_INTERPRET (these tests) a kernel is no JITFunction: every call goes
    through kernel[grid], which the CPU kernel tests run."""
    assert not shrink_mod._SHRINK.usable
    assert shrink_mod._SHRINK.kept == {}


def test_a_launch_hook_turns_it_off_an_empty_chain_does_not(monkeypatch):
    """Triton keeps an empty HookChain where no profiler added a hook (never None)."""
    import triton

    chain = triton.knobs.runtime.launch_enter_hook
    assert not launch._hooked()
    monkeypatch.setattr(chain, "calls", [lambda metadata: None])
    assert launch._hooked()
    monkeypatch.setattr(chain, "calls", [])
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda metadata: None)
    assert launch._hooked()


@pytest.mark.parametrize("tokens", [3, 40])
def test_the_launchers_pass_every_parameter_in_signature_order(monkeypatch, tokens):
    """A kept binary is called with ptrs + scalars + constexpr values, positionally: the
    launchers must hand FastLaunch every runtime parameter of their kernel, in order
    (pointers first), and the constexprs by the signature's names and order."""
    import inspect

    import kernels.triton.lora_expand as expand_mod
    from kernels import build_meta, lora_shrink_expand
    from kernels.testing import random_slices, random_slots

    seen = {}

    class Spy:
        def __init__(self, name, real):
            self.name, self.real = name, real

        def __call__(self, grid, ptrs, scalars, constexprs, **options):
            seen[self.name] = (ptrs, scalars, constexprs)
            self.real(grid, ptrs, scalars, constexprs, **options)

    for mod, attr, name in ((shrink_mod, "_SHRINK", "shrink"), (expand_mod, "_EXPAND", "expand")):
        monkeypatch.setattr(mod, attr, Spy(name, getattr(mod, attr)))
    monkeypatch.setenv("LORAFLEET_KERNELS", "triton")
    slots = random_slots(tokens, 4, 3, 0.2)
    a = random_slices(4, [(8, 32)] * 3, torch.float32, "cpu", 0.1)
    b = random_slices(4, [(16, 8), (8, 8), (8, 8)], torch.float32, "cpu", 0.1)
    y = torch.zeros(tokens, 32)
    lora_shrink_expand(y, torch.randn(tokens, 32), a, b, build_meta(slots, 4, max_rank=8))
    for name, kernel in (
        ("shrink", shrink_mod._shrink_kernel),
        ("expand", expand_mod._expand_kernel),
    ):
        params = list(inspect.signature(kernel.fn).parameters.values())
        runtime = [p.name for p in params if "constexpr" not in str(p.annotation)]
        ptrs, scalars, constexprs = seen[name]
        assert len(ptrs) + len(scalars) == len(runtime), name
        assert all(isinstance(t, torch.Tensor) for t in ptrs), name
        assert not any(isinstance(v, torch.Tensor) for v in scalars), name
        assert all(n.endswith("_ptr") for n in runtime[: len(ptrs)]), name
        assert tuple(constexprs) == tuple(p.name for p in params[len(runtime) :]), name
