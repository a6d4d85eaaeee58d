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


class FakeCompiled:
    """What :meth:`launch.DirectLaunch.of` reads of a compiled kernel."""

    def __init__(self, signature, metas, packed=(4, 1, 1024)):
        self.packed_metadata = packed
        self.src = type("Src", (), {"signature": signature})()
        self.metadata = type("Meta", (), {"tensordesc_meta": metas})()


class FakeRunner:
    launch_cooperative_grid = False
    launch_pdl = False


def test_direct_launch_packs_parameters_as_the_driver_reads_them(monkeypatch):
    import ctypes
    import struct

    launched = []
    monkeypatch.setattr(launch, "_cu_launch_kernel", lambda: lambda *a: launched.append(a) or 0)
    tmap = bytes(range(128))
    monkeypatch.setattr(launch, "_tensormap_bytes", lambda obj: tmap)
    sig = {"p": "*bf16", "n": "i32", "x": "fp32", "c": "constexpr", "d": "tensordesc<bf16[64, 32]>", "h": "bf16"}
    sig.update(b="i1", w="i64", u="u8")
    d = launch.DirectLaunch.of(FakeCompiled(sig, [{"swizzle": 1}]), FakeRunner())
    assert d.threads == 128 and d.shared == 1024
    assert d.kinds == ["Q", "i", "f", None, "tma", "i", "i", "q", "q", "bf16", "b", "q", "B"]
    # the launcher's arguments: pointer, i32, f32, a constexpr, the descriptor (map, shape, strides), ...
    values = (0x7F0000001230, -5, 2.5, 64, object(), 100, 32, 4096, 1, -1.75, True, -(2**40), 200)
    addr, keep = d.pack(values)
    ptrs = (ctypes.c_void_p * 14).from_address(addr)
    sizes = [8, 4, 4, 128, 4, 4, 8, 8, 2, 1, 8, 1, 8, 8]
    got = [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]
    want = [
        struct.pack("<Q", 0x7F0000001230),
        struct.pack("<i", -5),
        struct.pack("<f", 2.5),
        tmap,
        struct.pack("<i", 100),
        struct.pack("<i", 32),
        struct.pack("<q", 4096),
        struct.pack("<q", 1),
        struct.pack("<f", -1.75)[2:],  # (bf16: float32's upper half)
        b"\x01",
        struct.pack("<q", -(2**40)),
        bytes([200]),
        bytes(8),  # global_scratch
        bytes(8),  # profile_scratch
    ]
    assert got == want
    assert ptrs[3] % 64 == 0  # (the CUtensorMap aligned)
    assert d.launch(99, (3, 2, 1), 1234, (addr, keep)) == 0
    assert launched == [(99, 3, 2, 1, 128, 1, 1, 1024, 1234, addr, None)]
    assert d.pack(values[:-1]) is None  # (another argument count: Triton's C function)
    assert d.pack(values[:1] + (2**40,) + values[2:]) is None  # (an i32 out of range: Triton reports it)


def test_direct_launch_declines_what_it_does_not_pack(monkeypatch):
    monkeypatch.setattr(launch, "_cu_launch_kernel", lambda: lambda *a: 0)
    assert launch.DirectLaunch.of(FakeCompiled({"p": "*fp32"}, [], packed=(4, 2, 0)), FakeRunner()) is None
    assert launch.DirectLaunch.of(FakeCompiled({"t": ("i32", "i32")}, []), FakeRunner()) is None
    assert launch.DirectLaunch.of(FakeCompiled({"d": "tensordesc<bf16[64, 32]>"}, [None]), FakeRunner()) is None
    coop = FakeRunner()
    coop.launch_cooperative_grid = True
    assert launch.DirectLaunch.of(FakeCompiled({"p": "*fp32"}, []), coop) is None
    monkeypatch.setattr(launch, "_cu_launch_kernel", lambda: None)
    assert launch.DirectLaunch.of(FakeCompiled({"p": "*fp32"}, []), FakeRunner()) is None


def test_bound_launch_falls_back_to_tritons_function_where_the_driver_refuses(monkeypatch):
    t0, t1 = torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8)
    b, raw, n = bound_for(monkeypatch, (t0, t1), n_desc=0)
    codes = []

    class Direct:
        def pack(self, values):
            return ("block", values)

        def launch(self, function, grid, stream, block):
            codes.append(block)
            return 201 if len(codes) > 1 else 0  # (then CUDA_ERROR_INVALID_CONTEXT)

    b.direct = Direct()
    assert b((t0, t1)) and raw.calls == []  # launched by the driver call
    assert b((t0, t1)) and len(raw.calls) == 1  # refused: Triton's C function launches (or raises)
    assert codes[0] == codes[1] and codes[0][1][0] == t0.data_ptr()
