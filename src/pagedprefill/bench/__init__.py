"""pagedprefill-bench: prefill attention benchmarks over the project's workloads.

Usage (``pagedprefill-bench`` or ``python -m pagedprefill.bench``)::

    pagedprefill-bench                           # every workload: cudnn, triton, auto, FA3, FA2 side by side
    pagedprefill-bench --workloads varlen_b32 --backends triton,cudnn --markdown t.md --plot t.png
    pagedprefill-bench --cuda-graph              # each call captured in a CUDA graph, replays timed
    pagedprefill-bench --layers 32               # an engine's eager step: plan.run / one-shot per layer
    pagedprefill-bench --serving 1000            # serving loop: latency, builds, device memory over the run
    pagedprefill-bench --device cpu              # tiny CPU workloads on the torch backend (CPU figures)

The package, by concern: :mod:`.cli` (arguments, ``main``), :mod:`.cases` (calls built from the
workloads), :mod:`.checks` (correctness against a reference), :mod:`.timing` (CUDA events, L2 flush,
pre-loaded queue), :mod:`.references` (FlashAttention-3 and -2 varlen, the outside systems),
:mod:`.tables` (text / markdown tables, JSON rows, the plot), :mod:`.sweep` (table mode),
:mod:`.serving` and :mod:`.layers` (the two other modes), :mod:`.common` (shared helpers).

Results go to stdout (the table last); progress, one line per step, to stderr. Files are written
only where ``--out-json``, ``--markdown`` or ``--plot`` say.
"""

from .cli import main

__all__ = ["main"]
