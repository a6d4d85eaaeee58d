"""Backends. Each module exposes the same five names, and consumes only a ``PrefillBatch``:

``NAME``; ``unavailable_reason(device) -> str | None`` (why it cannot run on this machine);
``unsupported_reason(batch) -> str | None`` (why it cannot serve this call);
``workspace_bytes(batch) -> int`` (scratch it needs after the metadata); ``run(batch)`` (writes
``batch.out`` and ``batch.lse`` for the covered rows only).
"""
