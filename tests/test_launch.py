"""``pagedprefill.kernels.launch``: the bound launch's argument assembly (CPU: a recording launcher
stands in for Triton's C launch function; the real one runs in the GPU tests of the plan)."""

from __future__ import annotations

import pytest
import torch

from pagedprefill.kernels import launch

pytestmark = pytest.mark.skipif(launch.triton is None, reason="triton is not importable")


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def bound_for(monkeypatch, tensors, n_desc=2):
    """A BoundLaunch over the argument list [t0, 7, desc0, t1, 2.5, desc1, None] (tensors at 0 and 3,
    descriptors at 2 and 5 of the kernel arguments, over t1 and t0), as :func:`launch.bind` lays it
    out."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    head = [False, False, None, None, "packed", None, None, None]
    kernel_args = [None, 7, None, None, 2.5, None, None]
    template = head + kernel_args
    n = len(head)
    raw = Recorder()
    aligned = [t.data_ptr() % 16 == 0 for t in tensors]
    desc_at, desc_base = [n + 2, n + 5][:n_desc], (1, 0)[:n_desc]
    metas = [{}] * n_desc
    b = launch.BoundLaunch(raw, template, [n, n + 3], aligned, desc_at, metas, 0, 99, (5, 1, 1), None, desc_base)
    return b, raw, n


class Desc:
    def __init__(self, name, base):
        self.name, self.base = name, base

    def __str__(self):
        return self.name


def test_bound_launch_passes_addresses_and_expands_descriptors_in_place(monkeypatch):
    t0, t1 = torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8)
    b, raw, n = bound_for(monkeypatch, (t0, t1))
    assert not b((t0, t1))  # descriptors not remembered yet: nothing launched
    assert raw.calls == []
    monkeypatch.setattr(launch, "_make_tensordesc_arg", lambda d, meta: [f"map{d}", 10, 20, 1])
    b.remember((t0, t1), (Desc("K", t1), Desc("Q", t0)))
    assert b((t0, t1))
    (args,) = raw.calls
    assert args[:5] == (5, 1, 1, 1234, 99)
    kern = list(args[5 + n :])
    assert kern == [t0.data_ptr(), 7, "mapK", 10, 20, 1, t1.data_ptr(), 2.5, "mapQ", 10, 20, 1, None]
    assert b((t0, t1)) and raw.calls[1] == raw.calls[0]  # the same addresses: the kept argument tuple
    assert len(b.calls) == 1 and all(type(a) is not torch.Tensor for a in next(iter(b.calls.values())))
    other = torch.empty(64, dtype=torch.uint8)
    assert not b((other, t1))  # a descriptor base address not seen: the caller takes Triton's path
    assert len(raw.calls) == 2
    b.remember((t0, t1), (Desc("K2", other), Desc("Q2", other)))  # bases other than the tensors': not kept
    assert not b((other, t1)) and len(raw.calls) == 2


def test_bound_launch_declines_hooks_and_alignment_changes(monkeypatch):
    buf = torch.empty(64, dtype=torch.uint8)
    t0, t1 = buf[:16], buf[16:32]
    b, raw, _ = bound_for(monkeypatch, (t0, t1), n_desc=0)
    assert b((t0, t1))
    assert not b((buf[1:17], t1))  # 16-byte alignment differs from the first launch's
    hook = launch.triton.knobs.runtime.launch_enter_hook
    if type(hook).__name__ == "HookChain":
        hook.add(print)
        try:
            assert not b((t0, t1))  # a profiler's hook: Triton's own path calls it
        finally:
            hook.remove(print)
    assert b((t0, t1))
    monkeypatch.setattr(launch.triton.knobs.runtime, "debug", not launch.triton.knobs.runtime.debug)
    assert not b((t0, t1))  # debug turned on since the first launch: another compiled kernel
    monkeypatch.undo()
    assert len(raw.calls) == 2


def test_launch_slot_binds_once_and_keys_what_else_the_binding_depends_on(monkeypatch):
    made, fast = [], []

    class Bound:
        def __call__(self, tensors):
            made.append(tensors)
            return True

    monkeypatch.setattr(launch, "bind", lambda kernel, grid, args, kwargs: Bound())
    monkeypatch.setattr(launch, "fast_launch", lambda kernel, grid, args, kwargs: fast.append(args))
    slot = launch.LaunchSlot()
    assert not slot.launch(("t",), 3)  # not bound yet: the caller launches through Triton
    slot.run("kernel", (1,), ("a",), {}, 3)
    assert slot.launch(("t",), 3) and made == [("t",)]
    assert not slot.launch(("t",), 4)  # bound with another key: Triton's path
    slot.run("kernel", (1,), ("b",), {}, 4)
    assert fast == [("b",)] and slot.key == 3  # (bound once; later launches through fast_launch)
    unbindable = launch.LaunchSlot()
    monkeypatch.setattr(launch, "bind", lambda kernel, grid, args, kwargs: None)
    unbindable.run("kernel", (1,), ("c",), {})
    assert unbindable.bound is False and not unbindable.launch(("t",))
