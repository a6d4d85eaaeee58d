"""Benchmark workloads: loading them, their exact lengths and FLOPs, and building a call from one.

The rules are those of the workloads' README (kept beside the copied ``workloads.json``):

- lengths: ``g = torch.Generator().manual_seed(w.get("seed", 0))``; q lengths are
  ``[qo_len] * batch`` or ``torch.randint(qo_min, qo_max + 1, (batch,), generator=g)``; then the
  prefixes ``[prefix] * batch`` or ``torch.randint(0, prefix_max + 1, (batch,), generator=g)``,
  drawn after the q lengths from the same generator; ``kv_len = q_len + prefix``;
- data: standard-normal bf16 q, K, V. ``dtype`` ``fp8_kv``: q bf16, K/V stored as e4m3 of
  ``value / 0.5`` with ``k_scale = v_scale = 0.5``; ``dtype`` ``fp8``: q, K and V all e4m3 that way,
  ``q_scale = 0.5`` too, output bf16 (the scales are one-element float32 tensors). The bf16 data an
  fp8 workload was made from is what a system without fp8 runs. Paged K/V (``page_size > 0``) stored NHD
  ``(num_pages, page_size, Hkv, D)`` and passed as the ``.permute(0, 2, 1, 3)`` view, the pages of
  all sequences shuffled by one random permutation, an int32 block table; ``page_size == 0``:
  ragged contiguous K/V ``(total_kv_tokens, Hkv, D)`` with element batch offsets;
- causal is bottom-right aligned; scale = 1/sqrt(head_dim_qk);
- FLOPs: per sequence and query head, ``2 * (Dqk + Dvo) * visible (i, j) pairs``.

Everything here is shared by :mod:`pagedprefill.bench` and :mod:`pagedprefill.demo`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from importlib import resources

import torch
from torch import Tensor

from pagedprefill.batch import visible_pairs

__all__ = [
    "CPU_WORKLOADS",
    "FP8_DTYPE",
    "FP8_SCALE",
    "add_workloads",
    "build_case",
    "case_lengths",
    "check_workload",
    "data_kind",
    "dense_reference_inputs",
    "flops",
    "get_workload",
    "lengths",
    "load_workloads",
    "quantize_case",
    "quantize_fp8",
    "read_workloads",
    "reference_fp64",
    "visible_pairs",
]

GPU_WORKSPACE_BYTES = 256 * 2**20
CPU_WORKSPACE_BYTES = 8 * 2**20
FP8_DTYPE = torch.float8_e4m3fn
FP8_SCALE = 0.5  # real value = stored value x 0.5, for q (dtype fp8), K and V (fp8_kv and fp8)
DATA_KINDS = ("bf16", "fp8_kv", "fp8")

# Tiny workloads for machines without a GPU, derived from the real ones (same rules, same keys):
# paged with page 16, page 1, ragged K/V, a variable-length non-causal batch, and both fp8 kinds.
_CPU_COMMON = {"heads_q": 4, "heads_kv": 2, "head_dim_qk": 64, "head_dim_vo": 64}
CPU_WORKLOADS: list[dict] = [
    {"name": "cpu_b2_q64_p64", "batch": 2, "qo_len": 64, "prefix": 64, "page_size": 16, "causal": True},
    {"name": "cpu_page1_b2_q64_p64", "batch": 2, "qo_len": 64, "prefix": 64, "page_size": 1, "causal": True},
    {"name": "cpu_ragged_b2_q64_p64", "batch": 2, "qo_len": 64, "prefix": 64, "page_size": 0, "causal": True},
    {
        "name": "cpu_varlen_b4_noncausal",
        "batch": 4,
        "qo_min": 8,
        "qo_max": 64,
        "prefix_max": 64,
        "seed": 7,
        "page_size": 16,
        "causal": False,
    },
    {
        "name": "cpu_fp8kv_b2_q64",
        "batch": 2,
        "qo_len": 64,
        "prefix": 32,
        "page_size": 16,
        "causal": True,
        "dtype": "fp8_kv",
    },
    {
        "name": "cpu_fp8_b2_q64",
        "batch": 2,
        "qo_len": 64,
        "prefix": 0,
        "page_size": 16,
        "causal": True,
        "dtype": "fp8",
    },
]
for _w in CPU_WORKLOADS:
    for _k, _v in _CPU_COMMON.items():
        _w.setdefault(_k, _v)
del _w, _k, _v


def load_workloads() -> list[dict]:
    """The project's benchmark workloads (package data ``workloads.json``), in file order."""
    text = resources.files("pagedprefill").joinpath("workloads.json").read_text(encoding="utf-8")
    return [dict(w) for w in json.loads(text)["workloads"]]


# workloads added from a user's file (:func:`add_workloads`), after the project's and the CPU ones
_ADDED: list[dict] = []

_INT_KEYS = {"batch": 1, "heads_q": 1, "heads_kv": 1, "head_dim_qk": 1, "page_size": 0}
_OPTIONAL_INT_KEYS = {"head_dim_vo": 1, "qo_len": 0, "qo_min": 0, "qo_max": 0, "prefix": 0, "prefix_max": 0, "seed": 0}
_KEYS = {"name", "causal", "dtype", *_INT_KEYS, *_OPTIONAL_INT_KEYS}


def check_workload(w: object, where: str = "workload") -> dict:
    """One workload entry as ``workloads.json`` holds it, checked: ``name``; ints ``batch``,
    ``heads_q``, ``heads_kv`` (dividing ``heads_q``), ``head_dim_qk``, ``page_size`` (0: ragged
    K/V); ``qo_len`` or ``qo_min`` <= ``qo_max``; ``prefix`` or ``prefix_max``; bool ``causal``;
    optional ``head_dim_vo`` (default ``head_dim_qk``), ``seed`` and ``dtype`` (one of
    ``DATA_KINDS``); no other key. Raises ValueError naming the entry and the key."""
    if not isinstance(w, dict):
        raise ValueError(f"{where}: expected an object of workload keys, got {type(w).__name__}")
    name = w.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: 'name' expected a non-empty string, got {name!r}")
    where = f"workload {name!r}"
    unknown = sorted(set(w) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected keys among {sorted(_KEYS)}")
    for key, low in {**_INT_KEYS, **_OPTIONAL_INT_KEYS}.items():
        if key not in w and key in _OPTIONAL_INT_KEYS:  # (present as null: refused below)
            continue
        v = w.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {key!r} expected an int >= {low}, got {v!r}")
    if w["heads_q"] % w["heads_kv"]:
        raise ValueError(f"{where}: 'heads_kv' expected a divisor of heads_q = {w['heads_q']}, got {w['heads_kv']}")
    if "qo_len" not in w and not ("qo_min" in w and "qo_max" in w and w["qo_min"] <= w["qo_max"]):
        raise ValueError(f"{where}: expected 'qo_len', or 'qo_min' <= 'qo_max'")
    if "prefix" not in w and "prefix_max" not in w:
        raise ValueError(f"{where}: expected 'prefix' or 'prefix_max'")
    if not isinstance(w.get("causal"), bool):
        raise ValueError(f"{where}: 'causal' expected true or false, got {w.get('causal')!r}")
    data_kind(w)
    return {**w, "head_dim_vo": w.get("head_dim_vo", w["head_dim_qk"])}


def read_workloads(path: str) -> list[dict]:
    """The workloads of a JSON file: a list of entries, or an object with a ``"workloads"`` list
    (``workloads.json``'s form), each checked by :func:`check_workload`; names must be unique."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"workloads file {path}: {e}") from e
    entries = data.get("workloads") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ValueError(f"workloads file {path}: expected a list of workloads (or {{'workloads': [...]}})")
    out = [check_workload(w, f"{path} entry {i}") for i, w in enumerate(entries)]
    names = [w["name"] for w in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"workloads file {path}: names must be unique, repeated: {', '.join(dup)}")
    return out


def add_workloads(entries: Sequence[dict]) -> None:
    """Make ``entries`` (checked) known to :func:`get_workload`; a name the project already uses is
    refused, one added before is replaced."""
    taken = {w["name"] for w in load_workloads() + CPU_WORKLOADS}
    checked = [check_workload(w) for w in entries]  # (all checked before any is added)
    for w in checked:
        if w["name"] in taken:
            raise ValueError(f"workload {w['name']!r}: the name of one of the project's workloads; choose another")
    for w in checked:
        _ADDED[:] = [x for x in _ADDED if x["name"] != w["name"]] + [w]


def get_workload(name: str) -> dict:
    """A workload by name, from ``workloads.json``, :data:`CPU_WORKLOADS` or :func:`add_workloads`."""
    for w in load_workloads() + CPU_WORKLOADS + _ADDED:
        if w["name"] == name:
            return dict(w)
    known = [w["name"] for w in load_workloads() + CPU_WORKLOADS + _ADDED]
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(known)}")


def data_kind(w: dict) -> str:
    """The workload's data: ``"bf16"`` (the default), ``"fp8_kv"`` or ``"fp8"``."""
    kind = w.get("dtype", "bf16")
    if kind not in DATA_KINDS:
        raise ValueError(f"workload {w.get('name')!r}: dtype must be one of {DATA_KINDS}, got {kind!r}")
    return kind


def lengths(w: dict) -> tuple[list[int], list[int]]:
    """``(q_lens, kv_lens)`` of workload ``w``, exactly as the shared list's README draws them (one
    generator seeded with the workload's seed)."""
    batch = int(w["batch"])
    g = torch.Generator().manual_seed(int(w.get("seed", 0)))
    if "qo_len" in w:
        q_lens = [int(w["qo_len"])] * batch
    else:
        q_lens = torch.randint(int(w["qo_min"]), int(w["qo_max"]) + 1, (batch,), generator=g).tolist()
    if "prefix" in w:
        prefixes = [int(w["prefix"])] * batch
    else:
        prefixes = torch.randint(0, int(w["prefix_max"]) + 1, (batch,), generator=g).tolist()
    return q_lens, [q + p for q, p in zip(q_lens, prefixes)]


def flops(
    w_or_lens: dict | tuple[Sequence[int], Sequence[int]],
    causal: bool | None = None,
    num_qo_heads: int | None = None,
    head_dim_qk: int | None = None,
    head_dim_vo: int | None = None,
) -> int:
    """FLOPs of one call: ``sum over sequences and query heads of 2 * (Dqk + Dvo) * visible pairs``.

    Either ``flops(workload)`` or ``flops((q_lens, kv_lens), causal, Hq, Dqk, Dvo)``; with a workload
    dict, explicit arguments override its fields. The count is the same for fp8 and 16-bit data.
    """
    if isinstance(w_or_lens, dict):
        w = w_or_lens
        q_lens, kv_lens = lengths(w)
        causal = bool(w["causal"]) if causal is None else causal
        num_qo_heads = int(w["heads_q"]) if num_qo_heads is None else num_qo_heads
        head_dim_qk = int(w["head_dim_qk"]) if head_dim_qk is None else head_dim_qk
        head_dim_vo = int(w.get("head_dim_vo", head_dim_qk)) if head_dim_vo is None else head_dim_vo
    else:
        q_lens, kv_lens = w_or_lens
        if causal is None or num_qo_heads is None or head_dim_qk is None:
            raise ValueError("flops(lens, ...): causal, num_qo_heads and head_dim_qk are required")
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
    q_lens, kv_lens = [int(x) for x in q_lens], [int(x) for x in kv_lens]
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"flops: {len(q_lens)} q lengths but {len(kv_lens)} kv lengths")
    pairs = sum(visible_pairs(q, k, bool(causal)) for q, k in zip(q_lens, kv_lens))
    return 2 * (head_dim_qk + head_dim_vo) * num_qo_heads * pairs


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> Tensor:
    """Standard normal values in ``dtype``, generated on ``device`` (no float32 copy of big tensors)."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def quantize_fp8(x: Tensor, scale: float = FP8_SCALE) -> Tensor:
    """e4m3 of ``x / scale`` (so that real value = stored value x ``scale``), with ``x``'s strides.

    Dividing by a power of two is exact in every float dtype, so the only rounding is the final
    conversion to e4m3, from the exact value.
    """
    out = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=FP8_DTYPE, device=x.device)
    out.copy_(x / scale)
    return out


def quantize_case(case: dict, kind: str, scale: float = FP8_SCALE) -> dict:
    """The fp8 version of a 16-bit case from :func:`build_case`, as the README builds fp8 workloads.

    ``kind`` ``"fp8_kv"``: q unchanged, ``k_cache`` / ``v_cache`` e4m3 of value / ``scale`` (same
    layout: the NHD pages stay NHD) with ``k_scale = v_scale = scale``; ``"fp8"``: q quantized too,
    with ``q_scale = scale``, and a bf16 output buffer. The scales are one-element float32 tensors on
    q's device. Lengths, offsets, block table and workspace are shared with ``case``; ``out`` and
    ``lse`` are new buffers.
    """
    if kind not in ("fp8_kv", "fp8"):
        raise ValueError(f"quantize_case: kind must be 'fp8_kv' or 'fp8', got {kind!r}")
    q = case["q"]
    dev = q.device

    def one(x: float) -> Tensor:
        return torch.full((1,), float(x), dtype=torch.float32, device=dev)

    new = dict(case)
    new["k_cache"] = quantize_fp8(case["k_cache"], scale)
    new["v_cache"] = quantize_fp8(case["v_cache"], scale)
    new["k_scale"], new["v_scale"] = one(scale), one(scale)
    out_dtype = q.dtype
    if kind == "fp8":
        new["q"] = quantize_fp8(q, scale)
        new["q_scale"] = one(scale)
        out_dtype = torch.bfloat16  # the library's default output for fp8 q (o_data_type None)
    new["out"] = torch.empty(tuple(case["out"].shape), dtype=out_dtype, device=dev)
    new["lse"] = torch.full_like(case["lse"], float("-inf"))
    return new


DTYPE_SUFFIXES = ("fp8kv", "fp8", "bf16")  # (named_case: the data a name's kernel runs on)
ORDER_SUFFIXES = ("longest", "devlens")


def named_case(name: str, device: str | torch.device, seed: int = 0) -> dict:
    """:func:`build_case` of a workload named ``name``, bf16, without LSE (the scripts that time or
    profile one kernel take such names). Suffixes, each after a colon: ``fp8kv`` runs its 16-bit data
    with K/V quantized to e4m3 (q unchanged), ``fp8`` with q, K and V quantized, ``bf16`` an fp8
    workload's 16-bit data; ``longest`` puts its sequences in order of visible query-key pairs,
    most first (the same lengths); ``devlens`` puts lengths and offsets on the device."""
    base, *kinds = name.split(":")
    w = get_workload(base)
    dtypes = [k for k in kinds if k in DTYPE_SUFFIXES]
    for k in kinds:
        if k not in DTYPE_SUFFIXES + ORDER_SUFFIXES or kinds.count(k) > 1:
            known = ", ".join(DTYPE_SUFFIXES + ORDER_SUFFIXES)
            raise ValueError(f"workload suffix {k!r} of {name!r}: expected each of {known} at most once")
    if len(dtypes) > 1:
        raise ValueError(f"workload suffixes {dtypes} of {name!r}: expected one of fp8kv, fp8 or bf16")
    lens = None
    if "longest" in kinds:
        causal = bool(w["causal"])
        pairs = sorted(zip(*lengths(w)), key=lambda qk: -visible_pairs(qk[0], qk[1], causal))
        lens = ([q for q, _ in pairs], [k for _, k in pairs])
    kind = dtypes[0] if dtypes else ""
    opts = dict(seed=seed, lens_on_device="devlens" in kinds, lens=lens)
    if kind:
        kw = build_case(w, device, dtype=torch.bfloat16, fp8=False, **opts)
        if kind != "bf16":
            kw = quantize_case(kw, "fp8_kv" if kind == "fp8kv" else "fp8")
    else:
        kw = build_case(w, device, dtype=torch.bfloat16, **opts)
    kw.pop("lse", None)
    kw["return_lse"] = False
    return kw


def build_case(
    w: dict,
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    *,
    lens_on_device: bool = False,
    workspace_bytes: int | None = None,
    lens: tuple[Sequence[int], Sequence[int]] | None = None,
    fp8: bool = True,
) -> dict:
    """Keyword arguments of one call of the public function for workload ``w``.

    ``dtype``: the 16-bit (or float32) data type of q, K and V (bf16 as the README says; fp16 / fp32
    where a backend needs them, e.g. Triton's CPU interpreter). ``fp8=True`` (default): a workload of
    ``dtype`` ``fp8_kv`` / ``fp8`` is returned quantized from that data (:func:`quantize_case`);
    ``False``: its 16-bit data. ``lens_on_device=False`` (default): lengths on the CPU (the library
    validates them without a device sync); True: lengths on the device and
    ``is_cuda_graph_compatible=True`` (the CUDA-graph serving setup). ``seed`` seeds the data and the
    page permutation (the lengths come from the workload's own seed). ``lens`` overrides the
    workload's lengths.

    Returns the kwargs: ``q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence,
    max_sequence_kv, actual_seq_lens_q, actual_seq_lens_kv, causal, return_lse=True, out, lse,
    is_cuda_graph_compatible``, ``block_tables`` (paged) or ``batch_offsets_k/_v`` (ragged, in
    elements), and ``q_scale`` / ``k_scale`` / ``v_scale`` for fp8 data.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kind = data_kind(w)
    q_lens, kv_lens = lengths(w) if lens is None else ([int(x) for x in lens[0]], [int(x) for x in lens[1]])
    bsz = len(q_lens)
    hq, hkv = int(w["heads_q"]), int(w["heads_kv"])
    dqk = int(w["head_dim_qk"])
    dvo = int(w.get("head_dim_vo", dqk))
    page = int(w["page_size"])
    causal = bool(w["causal"])
    total_q, total_kv = sum(q_lens), sum(kv_lens)
    max_q, max_kv = max(q_lens + [0]), max(kv_lens + [0])

    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    q = _randn((total_q, hq, dqk), dtype, gen, device)
    kw: dict = {"q": q}
    lens_dev = device if lens_on_device else torch.device("cpu")
    if page > 0:
        pages_per_seq = [-(-n // page) for n in kv_lens]
        num_pages = max(sum(pages_per_seq), 1)
        k_store = _randn((num_pages, page, hkv, dqk), dtype, gen, device)
        v_store = _randn((num_pages, page, hkv, dvo), dtype, gen, device)
        perm = torch.randperm(num_pages, generator=cpu_gen)
        table = torch.zeros((bsz, max(pages_per_seq + [1])), dtype=torch.int32)
        start = 0
        for b, n in enumerate(pages_per_seq):
            table[b, :n] = perm[start : start + n]
            start += n
        kw.update(
            k_cache=k_store.permute(0, 2, 1, 3),
            v_cache=v_store.permute(0, 2, 1, 3),
            block_tables=table.to(device),
        )
    else:
        k = _randn((max(total_kv, 1), hkv, dqk), dtype, gen, device)
        v = _randn((max(total_kv, 1), hkv, dvo), dtype, gen, device)
        starts = [0]
        for n in kv_lens:
            starts.append(starts[-1] + n)
        off_dtype = torch.int32 if starts[-1] * hkv * max(dqk, dvo) < 2**31 else torch.int64
        kw.update(
            k_cache=k,
            v_cache=v,
            batch_offsets_k=torch.tensor([s * hkv * dqk for s in starts], dtype=off_dtype, device=lens_dev),
            batch_offsets_v=torch.tensor([s * hkv * dvo for s in starts], dtype=off_dtype, device=lens_dev),
        )
    kw.update(
        scale=1.0 / math.sqrt(dqk),
        workspace_buffer=torch.empty(
            workspace_bytes
            if workspace_bytes is not None
            else (GPU_WORKSPACE_BYTES if device.type == "cuda" else CPU_WORKSPACE_BYTES),
            dtype=torch.uint8,
            device=device,
        ),
        max_token_per_sequence=max_q,
        max_sequence_kv=max_kv,
        actual_seq_lens_q=torch.tensor(q_lens, dtype=torch.int32, device=lens_dev),
        actual_seq_lens_kv=torch.tensor(kv_lens, dtype=torch.int32, device=lens_dev),
        causal=causal,
        return_lse=True,
        out=torch.empty((total_q, hq, dvo), dtype=dtype, device=device),
        lse=torch.full((bsz, max_q, hq), float("-inf"), dtype=torch.float32, device=device),
        is_cuda_graph_compatible=bool(lens_on_device and device.type == "cuda"),
    )
    if fp8 and kind != "bf16":
        return quantize_case(kw, kind)
    return kw


def case_lengths(case: dict) -> tuple[list[int], list[int]]:
    """``(q_lens, kv_lens)`` of a case built by :func:`build_case`."""
    return (
        [int(x) for x in case["actual_seq_lens_q"].reshape(-1).tolist()],
        [int(x) for x in case["actual_seq_lens_kv"].reshape(-1).tolist()],
    )


def _bytes(t: Tensor) -> Tensor:
    """An fp8 tensor as uint8 (same strides): gathers and copies need not support fp8 dtypes."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _scale_value(s: object) -> float | None:
    if s is None:
        return None
    return float(s.reshape(-1)[0]) if isinstance(s, Tensor) else float(s)


def dense_reference_inputs(case: dict) -> dict:
    """The case's data stored contiguously, for outside (non-paged) references.

    Returns ``q (total_q, Hq, Dqk)``, ``k (total_kv, Hkv, Dqk)``, ``v (total_kv, Hkv, Dvo)`` (all
    contiguous, on the case's device, in the case's dtypes, fp8 included), ``cu_seqlens_q`` /
    ``cu_seqlens_k`` ((B+1,) int32 on that device), ``max_q``, ``max_k``, ``scale``, ``causal``,
    ``q_lens``, ``kv_lens`` and ``q_scale`` / ``k_scale`` / ``v_scale`` (floats, None when the
    tensor is not scaled). Paged K/V are gathered page by page through the block table.
    """
    q_lens, kv_lens = case_lengths(case)
    k_cache, v_cache = case["k_cache"], case["v_cache"]
    device = case["q"].device
    ks, vs = [], []
    table = case.get("block_tables")
    if table is not None:
        table = table.to(device=device, dtype=torch.long)
        page = k_cache.shape[2]
        for b, n in enumerate(kv_lens):
            if n == 0:
                continue
            pages = table[b, : -(-n // page)]
            for cache, acc in ((k_cache, ks), (v_cache, vs)):
                seq = _bytes(cache).index_select(0, pages)  # (n_pages, Hkv, page, D)
                acc.append(seq.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:n])
    else:

        def token_starts(name: str, per_token: int) -> list[int]:
            offs = case.get(name)
            if offs is None:
                acc, out = 0, []
                for n in kv_lens:
                    out.append(acc)
                    acc += n
                return out
            vals = [int(x) for x in offs.reshape(-1).tolist()]
            if case.get("batch_offsets_units", "elements") == "elements":
                vals = [x // per_token for x in vals]
            return vals[: len(kv_lens)]

        k_st = token_starts("batch_offsets_k", k_cache.shape[1] * k_cache.shape[2])
        v_st = token_starts("batch_offsets_v", v_cache.shape[1] * v_cache.shape[2])
        for b, n in enumerate(kv_lens):
            if n:
                ks.append(_bytes(k_cache)[k_st[b] : k_st[b] + n])
                vs.append(_bytes(v_cache)[v_st[b] : v_st[b] + n])
    hkv = k_cache.shape[1]
    if ks:
        k = torch.cat(ks).contiguous().view(k_cache.dtype)
        v = torch.cat(vs).contiguous().view(v_cache.dtype)
    else:
        k = k_cache.new_empty((0, hkv, k_cache.shape[-1]))
        v = v_cache.new_empty((0, hkv, v_cache.shape[-1]))

    def cu(lens: list[int]) -> Tensor:
        acc = [0]
        for n in lens:
            acc.append(acc[-1] + n)
        return torch.tensor(acc, dtype=torch.int32, device=device)

    total_q = sum(q_lens)
    q = case["q"][:total_q]
    return {
        "q": _bytes(q).contiguous().view(q.dtype),
        "k": k,
        "v": v,
        "cu_seqlens_q": cu(q_lens),
        "cu_seqlens_k": cu(kv_lens),
        "max_q": max(q_lens + [0]),
        "max_k": max(kv_lens + [0]),
        "scale": float(case["scale"]),
        "causal": bool(case["causal"]),
        "q_lens": q_lens,
        "kv_lens": kv_lens,
        "q_scale": _scale_value(case.get("q_scale")),
        "k_scale": _scale_value(case.get("k_scale")),
        "v_scale": _scale_value(case.get("v_scale")),
    }


def reference_fp64(dense: dict) -> tuple[Tensor, list[Tensor]]:
    """Float64 attention on :func:`dense_reference_inputs`' data (CPU; meant for small cases).

    Returns ``out`` (total_q, Hq, Dvo) float64 and, per sequence, its lse (q_len, Hq) float64.
    Independent of the library: explicit mask, softmax and GQA head mapping; fp8 data is multiplied
    by its scale (real value = stored value x scale).
    """

    def real(name: str) -> Tensor:
        x = dense[name].detach().cpu().double()
        s = dense.get(f"{name}_scale")
        return x * s if s is not None else x

    q, k, v = real("q"), real("k"), real("v")
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    out = torch.zeros((q.shape[0], hq, v.shape[-1]), dtype=torch.float64)
    lses = []
    q0 = k0 = 0
    for lq, lk in zip(dense["q_lens"], dense["kv_lens"]):
        qs = q[q0 : q0 + lq].transpose(0, 1)  # (Hq, lq, D)
        kh = k[k0 : k0 + lk].repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, lk, D)
        vh = v[k0 : k0 + lk].repeat_interleave(group, dim=1).transpose(0, 1)
        s = torch.matmul(qs, kh.transpose(1, 2)) * dense["scale"]  # (Hq, lq, lk)
        if dense["causal"]:
            i = torch.arange(lq).view(-1, 1)
            j = torch.arange(lk).view(1, -1)
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1) if lk else torch.full((hq, lq), float("-inf"), dtype=torch.float64)
        p = torch.exp(s - lse.unsqueeze(-1).clamp(min=-1e300))
        p = torch.nan_to_num(p, nan=0.0)
        out[q0 : q0 + lq] = torch.matmul(p, vh).transpose(0, 1) if lk else 0.0
        lses.append(lse.transpose(0, 1).contiguous())
        q0 += lq
        k0 += lk
    return out, lses
