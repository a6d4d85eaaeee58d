"""Backends. Each is one module (or package) with the same names, and consumes only a
:class:`~pagedprefill.batch.PrefillBatch` and, per run, :class:`~pagedprefill.batch.CallTensors`:

``NAME``; ``unavailable_reason(device) -> str | None`` (why it cannot run on this machine);
``unsupported_reason(batch) -> str | None`` (why it cannot serve this batch);
``plan(batch, workspace_bytes) -> plan`` where the plan has ``workspace_bytes`` (scratch it needs)
and ``run(tensors)`` (writes ``out`` and ``lse`` for the covered rows only).

No backend imports another; what two of them share lives in :mod:`pagedprefill.kernels`.
"""
