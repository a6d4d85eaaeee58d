"""Launching Triton/Gluon kernels with little host time, and whether Triton can run on a device.

``TRITON_INTERPRET``: Triton decides when a kernel is decorated (at the first import of the module
that defines it) whether it runs in the CPU interpreter. Set ``TRITON_INTERPRET=1`` before the
first import of pagedprefill to run the Triton kernels on the CPU; :func:`unavailable_reason`
names the case where it was set too late.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # triton is optional
    import triton

    IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - a Triton without Gluon
    TensorDescriptor = None

# Whether the kernels of this process were built for the interpreter (decided once, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
GRID_LIMIT = 65535  # CUDA's limit of grid dims y and z


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """A GPU's compute capability, asked once (the query builds the device's property object: it
    showed in the host time of every per-layer call that writes the device table)."""
    return torch.cuda.get_device_capability(index)


def unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None when they can)."""
    if triton is None:
        return f"triton is not importable ({IMPORT_ERROR}); pip install triton"
    if device.type == "cuda":
        if INTERPRETED:
            return None  # the interpreter copies device tensors to the host and back
        major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if major < 8:
            return f"the Triton kernels need CUDA compute capability >= 8.0, this GPU has {major}.{minor}"
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return "no CUDA GPU; set TRITON_INTERPRET=1 to run the Triton kernels on the CPU through the interpreter"
        if not INTERPRETED:
            return (
                "TRITON_INTERPRET=1 was set after pagedprefill was imported (Triton picks the "
                "interpreter when the kernels are decorated); set it before the import"
            )
        return None
    return f"device type {device.type!r} is not supported by the Triton kernels (CUDA only)"


def grid_chunks(n_y: int, n_z: int):
    """``(y0, ny, z0, nz)`` pieces of a grid whose y and z extents may pass CUDA's 65535 limit."""
    for y0 in range(0, n_y, GRID_LIMIT):
        for z0 in range(0, n_z, GRID_LIMIT):
            yield y0, min(GRID_LIMIT, n_y - y0), z0, min(GRID_LIMIT, n_z - z0)


# --------------------------------------------------------------------------------------------
# Launching without Triton's per-call argument binding
# --------------------------------------------------------------------------------------------

_LAUNCHES: dict = {}  # (kernel, device, knobs, kwargs, specialisation of args) -> (compiled, constexprs)
_LAUNCHES_MAX = 4096
# the Triton internals relied on (CompiledKernel[grid](*all params), KernelParam, knobs), as checked
_FAST_LAUNCH_TRITON = ("3", "6")
_TRITON_MINOR = tuple(triton.__version__.split(".")[:2]) if triton is not None else None


class _Uncacheable(Exception):
    """An argument fast_launch cannot key exactly: that launch goes through Triton's own path."""


def _spec_of(a: object) -> object:
    """At least everything Triton specialises a runtime argument on (finer is safe: a miss only means
    one launch through Triton's own path). Only tensors, ints, floats, bools, None and descriptors."""
    t = type(a)
    if t is int:
        if -(2**31) <= a < 2**31:
            wide = 0
        elif -(2**63) <= a < 2**63:
            wide = 1
        elif 0 <= a < 2**64:
            wide = 2
        else:
            raise _Uncacheable  # Triton refuses it: let it say so
        return (a == 1, a % 16 == 0, wide)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None or t is bool:
        return a
    if t is float:
        return float
    if TensorDescriptor is not None and t is TensorDescriptor:  # specialised on dtype, block and layout only
        return (t, a.base.dtype, tuple(a.block_shape), a.layout, a.padding)
    raise _Uncacheable  # tuples, constexprs, other descriptors, tensor-likes, ...


def _kwargs_key(kwargs: dict) -> tuple:
    """Constexprs and options by type and value (True, 1 and 1.0 compile apart); floats are not
    keyed (0.0 == -0.0, NaN != NaN)."""
    out = []
    for k, v in kwargs.items():
        if type(v) is float:
            raise _Uncacheable
        out.append((k, type(v), v))
    return tuple(out)


def _tritons_own_path(kernel, grid) -> bool:
    """Launches that always go through ``kernel[grid](...)``: the interpreter, a kernel with pre-run
    hooks, a callable grid, a Triton other than the one whose internals were checked."""
    return INTERPRETED or bool(kernel.pre_run_hooks) or callable(grid) or _TRITON_MINOR != _FAST_LAUNCH_TRITON


def fast_launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` where ``args`` are the positional (runtime) parameters and
    ``kwargs`` the constexprs and launch options. A launch whose argument specialisation, kwargs and
    device match an earlier one calls that compiled kernel directly, which skips Triton's per-call
    binding (about 30 µs of host time for a kernel with 30 arguments). The compiled kernel's own
    launcher still calls Triton's launch hooks (profilers); a kernel with pre-run hooks, a callable
    grid, another Triton version and the interpreter always take Triton's own path."""
    if _tritons_own_path(kernel, grid):
        kernel[grid](*args, **kwargs)
        return
    try:
        jit_knobs = _jit_knobs()
        device = triton.runtime.driver.active.get_current_device()
        key = (kernel, device, jit_knobs, _kwargs_key(kwargs), tuple(_spec_of(a) for a in args))
        hit = _LAUNCHES.get(key)
    except (_Uncacheable, TypeError):  # TypeError: an unhashable option
        kernel[grid](*args, **kwargs)
        return
    if hit is not None:
        compiled, constexprs = hit
        compiled[(*grid, 1, 1)[:3]](*args, *constexprs)
        return
    compiled = kernel[grid](*args, **kwargs)
    rest = kernel.params[len(args) :]
    if compiled is None or not hasattr(compiled, "function") or not all(p.is_constexpr for p in rest):
        return
    if len(_LAUNCHES) >= _LAUNCHES_MAX:
        _LAUNCHES.clear()
    _LAUNCHES[key] = (compiled, tuple(kwargs[p.name] if p.name in kwargs else p.default for p in rest))


class BoundLaunch:
    """One compiled kernel whose non-tensor arguments are fixed (a plan's layout): a call passes only
    its tensors' addresses straight to Triton's C launch function, skipping the argument binding,
    the specialisation key, the per-pointer driver queries and the per-call encoding of TMA
    descriptors (each is encoded once per base address and kept, at most ``DESC_CACHE``; no tensor
    is held). The argument list of each combination of addresses seen is kept too (at most
    ``CALL_CACHE``: ints only), so a layer run again with the same tensors costs one tuple lookup.

    Built by :func:`bind` from a first launch through Triton. A call returns False (nothing launched)
    where this path does not apply at the time (launch hooks set, another current device, descriptor
    base addresses not seen yet); the caller then launches through Triton's path and calls
    :meth:`remember` with the descriptors."""

    DESC_CACHE = 1024  # (an 80-layer model with four descriptors per layer: 320)
    CALL_CACHE = 512

    __slots__ = (
        "raw",
        "template",
        "tensor_at",
        "aligned",
        "desc_at",
        "desc_meta",
        "device",
        "function",
        "descs",
        "calls",
        "desc_base",
        "grid",
        "kernel",
        "jit_knobs",
    )

    def __init__(
        self, raw, template, tensor_at, aligned, desc_at, desc_meta, device, function, grid, kernel=None, desc_base=()
    ):
        self.raw, self.template, self.tensor_at, self.aligned = raw, template, tensor_at, aligned
        self.desc_at, self.desc_base = desc_at, tuple(desc_base)  # (desc_base: each one's base tensor's index)
        self.desc_meta, self.device, self.function, self.grid = desc_meta, device, function, grid
        self.descs: dict = {}
        self.calls: dict = {}  # the tensors' addresses -> the full argument tuple
        self.kernel = kernel  # (its pre-run hooks, when set later, need Triton's path)
        self.jit_knobs = _jit_knobs()

    def remember(self, tensors: tuple, descs: tuple) -> None:
        """Keep the encoding of ``descs`` (the kernel's TMA descriptors, in order) for calls whose
        descriptor base tensors (``tensors[desc_base[j]]``) have the addresses they have here."""
        if len(self.descs) + len(descs) > self.DESC_CACHE:
            self.descs.clear()
        for j, d in enumerate(descs):
            ptr = tensors[self.desc_base[j]].data_ptr()
            if d.base.data_ptr() == ptr:  # (else never kept: such calls keep taking Triton's path)
                self.descs[(j, ptr)] = _make_tensordesc_arg(d, self.desc_meta[j])

    def __call__(self, tensors: tuple) -> bool:
        """Launch with ``tensors`` (the kernel's tensor arguments, in order, each in the layout of the
        first launch's) and the descriptors remembered for their base tensors' addresses; False,
        launching nothing, where one was not remembered."""
        rt = triton.knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            return False
        if _jit_knobs() != self.jit_knobs or (self.kernel is not None and self.kernel.pre_run_hooks):
            return False  # (debug or instrumentation turned on since: another compiled kernel)
        if torch._C._cuda_getDevice() != self.device:
            return False
        ptrs = tuple(map(_DATA_PTR, tensors))
        args = self.calls.get(ptrs)
        if args is None:
            args = self._assemble(ptrs)
            if args is None:
                return False
        g = self.grid
        self.raw(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self.device), self.function, *args)
        return True

    def _assemble(self, ptrs: tuple) -> tuple | None:
        """The argument tuple for these addresses (kept), or None where an address's 16-byte
        alignment differs from the first launch's or a descriptor base was not remembered."""
        args = self.template.copy()
        for i, p, aligned in zip(self.tensor_at, ptrs, self.aligned):
            if ((p & 15) == 0) != aligned:  # (Triton specialises pointers on 16-byte alignment)
                return None
            args[i] = p
        for j in range(len(self.desc_at) - 1, -1, -1):  # (last first: each expands in place)
            enc = self.descs.get((j, ptrs[self.desc_base[j]]))
            if enc is None:
                return None
            i = self.desc_at[j]
            args[i : i + 1] = enc
        if len(self.calls) >= self.CALL_CACHE:
            self.calls.clear()
        out = self.calls[ptrs] = tuple(args)
        return out


_DATA_PTR = torch.Tensor.data_ptr


def _jit_knobs() -> tuple:
    """The Triton knobs a compiled kernel depends on beyond its arguments (as fast_launch keys them)."""
    return (triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)


def _hooked(hook) -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps a chain of hooks, empty by default)."""
    return hook is not None and (type(hook).__name__ != "HookChain" or bool(hook.calls))


def _raw_launcher(compiled):
    """Triton 3.6's C launch function under the compiled kernel's launcher, or None."""
    runner = compiled.run
    if getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
        return None, None  # (scratch is allocated per call by Triton's own path)
    fn = runner.launch
    if getattr(fn, "__closure__", None):  # wrap_handle_tensordesc's inner(): the C function is a cell
        cells = [c.cell_contents for c in fn.__closure__]
        fn = next((c for c in cells if type(c).__name__ == "builtin_function_or_method"), None)
    elif type(fn).__name__ != "builtin_function_or_method":
        fn = None
    return fn, runner


def bind(kernel, grid: tuple, args: tuple, kwargs: dict, desc_base: tuple = ()) -> BoundLaunch | None:
    """Launch ``kernel[grid](*args, **kwargs)`` through Triton and return a :class:`BoundLaunch` for
    later calls with the same non-tensor arguments (None where that cannot apply: the interpreter,
    another Triton, hooks, a callable grid, arguments other than tensors, numbers, None and
    descriptors). ``desc_base``: for each descriptor argument, in order, the index among the tensor
    arguments of its base tensor (a descriptor over any other tensor cannot be bound)."""
    if _tritons_own_path(kernel, grid):
        kernel[grid](*args, **kwargs)
        return None
    compiled = kernel[grid](*args, **kwargs)
    rest = kernel.params[len(args) :]
    if compiled is None or not hasattr(compiled, "function") or not all(p.is_constexpr for p in rest):
        return None
    try:
        raw, runner = _raw_launcher(compiled)
        if raw is None:
            return None
        from triton.backends.nvidia import driver as nv

        if nv._BASE_ARGS_FORMAT != "iiiKKppOOOOOO":
            return None
        full = list(args) + [kwargs[p.name] if p.name in kwargs else p.default for p in rest]
        metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
        template = [runner.launch_cooperative_grid, runner.launch_pdl, None, None, compiled.packed_metadata]
        template += [None, None, None]  # launch metadata and the enter / exit hooks (none: checked per call)
        tensor_at, aligned, desc_at, desc_meta = [], [], [], []
        n_desc = sum(1 for a in full if TensorDescriptor is not None and type(a) is TensorDescriptor)
        # (descriptors the frontend decomposed into pointer + sizes would pin their base tensors here)
        if n_desc and (len(metas) != n_desc or any(m is None for m in metas)):
            return None
        for a in full:
            if isinstance(a, torch.Tensor):
                tensor_at.append(len(template))
                aligned.append(a.data_ptr() % 16 == 0)
                template.append(None)
            elif TensorDescriptor is not None and type(a) is TensorDescriptor:
                desc_meta.append(metas[len(desc_at)])
                desc_at.append(len(template))
                template.append(None)
            elif a is None or type(a) in (int, float, bool):
                template.append(a)
            else:
                return None
        device = triton.runtime.driver.active.get_current_device()
        grid3 = (*grid, 1, 1)[:3]
        fn = compiled.function
        tensors = [a for a in full if isinstance(a, torch.Tensor)]
        descs = [a for a in full if TensorDescriptor is not None and type(a) is TensorDescriptor]
        if len(desc_base) != len(descs) or any(
            d.base.data_ptr() != tensors[i].data_ptr() for d, i in zip(descs, desc_base)
        ):
            return None
        return BoundLaunch(raw, template, tensor_at, aligned, desc_at, desc_meta, device, fn, grid3, kernel, desc_base)
    except Exception:  # pragma: no cover - Triton internals other than those checked
        return None


class LaunchSlot:
    """Where a caller keeps a launch bound to one layout's fixed arguments: :meth:`launch` tries the
    bound launch, :meth:`run` launches through Triton and binds at the first such launch (``key``:
    whatever else the binding depends on; a call with another key takes Triton's path)."""

    __slots__ = ("bound", "key")

    def __init__(self):
        self.bound: BoundLaunch | None | bool = None  # None: not tried yet; False: not bindable
        self.key = None

    def launch(self, tensors: tuple, key=None) -> bool:
        """Launch through the bound launch (see :meth:`BoundLaunch.__call__`); False where none applies."""
        b = self.bound
        return bool(b) and self.key == key and b(tensors)

    def run(self, kernel, grid: tuple, args: tuple, kwargs: dict, key=None) -> None:
        """The launch through Triton: bound the first time, else :func:`fast_launch` (kernels without
        TMA descriptors: one with descriptors is never bound here, see :func:`bind`'s ``desc_base``)."""
        if self.bound is None:
            self.bound, self.key = bind(kernel, grid, args, kwargs) or False, key
        else:
            fast_launch(kernel, grid, args, kwargs)


def _make_tensordesc_arg(d, meta) -> list:
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return list(make_tensordesc_arg(d, meta))


def compiled_variants(*kernels) -> int:
    """Kernel variants compiled so far in this process (all devices) for ``kernels``; 0 under the
    interpreter."""
    if triton is None or INTERPRETED:
        return 0
    return sum(sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels if k is not None)
