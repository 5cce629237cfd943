"""The chunked scan under every comparison: rows of an operand on the device, counts, a ULP histogram, the
first and the worst failing elements, and their names (layout axes and, through ragged offsets, the request)."""

from __future__ import annotations

from typing import Any

import numpy as np

from parity.library import bridge
from parity.library.bits import _as_torch, _torch, is_numpy

LAYOUTS = ("THD", "HT", "TH", "flat")
_AXES = {"THD": ("token", "head", "dim"), "HT": ("head", "token"), "TH": ("token", "head")}

ULP_BUCKETS = ("0", "1", "2", "3-4", "5-8", "9-16", ">16")
_BUCKET_EDGES = (0, 1, 2, 4, 8, 16)  # bucketize(right=False): x <= edge[i] lands in bucket i

_CHUNK = 1 << 24  # elements per device chunk: bounds the temporaries (~10 int64/f64 arrays of a chunk)
MAX_SHOWN = 8


class _Locator:
    """Names an element by layout axes and, through query_start_loc, its request.

    `layout` is one of `LAYOUTS` or a tuple of axis names, one per dimension (any names: `parity.library.crosscheck`);
    then `query_start_loc` indexes the axis named `ragged_axis` and the axes are named in array order.
    """

    def __init__(self, shape: tuple[int, ...], layout: str | tuple[str, ...] | None, query_start_loc: Any,
                 ragged_axis: str = "token"):
        if layout is None:
            layout = {3: "THD", 2: "HT"}.get(len(shape), "flat")
        if isinstance(layout, (tuple, list)):
            self.axes, self.order = tuple(str(a) for a in layout), tuple(str(a) for a in layout)
            self.ragged_axis = ragged_axis
            if len(self.axes) != len(shape):
                raise ValueError(f"axes {self.axes} name {len(self.axes)} dims, got {shape=}")
        elif layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or a tuple of axis names, got {layout!r}")
        elif layout != "flat" and len(_AXES[layout]) != len(shape):
            raise ValueError(f"layout {layout!r} needs {len(_AXES[layout])} dims, got {shape=}")
        else:
            self.axes = _AXES.get(layout, ())
            self.order, self.ragged_axis = ("head", "token", "dim"), "token"
        self.shape, self.layout = shape, layout
        self.qsl = None
        if query_start_loc is not None:
            self.qsl = np.asarray(bridge.to_numpy(query_start_loc), dtype=np.int64).reshape(-1)
            if self.qsl.size < 1:
                raise ValueError(f"query_start_loc needs at least one entry, got {self.qsl.shape=}")

    def __call__(self, flat: int) -> str:
        idx = tuple(int(i) for i in np.unravel_index(flat, self.shape)) if self.shape else ()
        if self.layout == "flat":
            return f"index {idx}"
        named = dict(zip(self.axes, idx))
        parts = []
        if self.qsl is not None and self.ragged_axis in named:
            t = named[self.ragged_axis]
            if t >= self.qsl[-1]:
                parts.append("padding")
            else:
                parts.append(f"req {int(np.searchsorted(self.qsl, t, side='right')) - 1}")
        parts += [f"{axis} {named[axis]}" for axis in self.order if axis in named]
        return " ".join(parts)

    def token_axis(self) -> int | None:
        return self.axes.index(self.ragged_axis) if self.ragged_axis in self.axes else None


def _pick_layout(layout: str | None, lse_layout: str | None, ndim: int) -> str | None:
    if layout is None and lse_layout is not None and ndim == 2:
        if lse_layout not in ("HT", "TH"):
            raise ValueError(f"lse_layout must be 'HT' or 'TH', got {lse_layout!r}")
        return lse_layout
    return layout


def _row_chunks(n_rows: int, row_numel: int):
    rows = max(1, _CHUNK // max(1, row_numel))
    for i in range(0, n_rows, rows):
        yield i, min(n_rows, i + rows)


def _chunk_of(x: Any, i: int, j: int, device) -> Any:
    """Rows [i, j) of a full-shape operand (torch, numpy or jax) as a flat array: numpy where `device` is None (a
    numpy comparison), else a torch tensor on `device`."""
    if device is None:
        return np.asarray(bridge.to_numpy(x))[i:j].reshape(-1)
    if isinstance(x, np.ndarray):
        return bridge.to_torch(x[i:j], device).reshape(-1)
    return _as_torch(x)[i:j].to(device).reshape(-1)


def _device_of(x: Any):
    """The device of a comparison's operand: None for numpy (compared with numpy), the torch device otherwise."""
    return None if is_numpy(x) else x.device


def _shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


class _Accumulator:
    def __init__(self, max_shown: int):
        self.max_shown = max_shown
        self.counts: dict[str, int] = {}
        self.hist = np.zeros(len(ULP_BUCKETS), dtype=np.int64)
        self.max_ulp: int | None = None
        self.examples: list[tuple[int, dict]] = []  # (flat index, fields)
        self.worst: tuple[float, int, dict] | None = None  # (score, flat index, fields)

    def count(self, key: str, mask) -> None:
        self.counts[key] = self.counts.get(key, 0) + int(mask.sum())

    def ulps(self, ulp, valid) -> None:
        """`ulp` and `valid`: flat arrays, numpy or torch (bucketed alike: x <= edge[i] lands in bucket i)."""
        u = ulp[valid]
        if u.shape[0] == 0:
            return
        if is_numpy(u):
            self.hist += np.bincount(np.searchsorted(np.asarray(_BUCKET_EDGES), u, side="left"),
                                     minlength=len(ULP_BUCKETS))
        else:
            torch = _torch()
            edges = torch.tensor(_BUCKET_EDGES, dtype=torch.int64, device=u.device)
            self.hist += torch.bincount(torch.bucketize(u, edges), minlength=len(ULP_BUCKETS)).cpu().numpy()
        m = int(u.max())
        self.max_ulp = m if self.max_ulp is None else max(self.max_ulp, m)

    def examples_from(self, base: int, fail, fields: dict) -> None:
        need = self.max_shown - len(self.examples)
        if need <= 0:
            return
        idx = np.flatnonzero(fail)[:need] if is_numpy(fail) else fail.nonzero().flatten()[:need]
        if idx.shape[0] == 0:
            return
        got = {k: v[idx].tolist() for k, v in fields.items()}
        for n, i in enumerate(idx.tolist()):
            self.examples.append((base + i, {k: v[n] for k, v in got.items()}))

    def worst_from(self, base: int, score, fields: dict) -> None:
        """Keeps the element with the highest score (score < 0: not a candidate); the first of equal ones."""
        if score.shape[0] == 0:
            return
        i = int(np.argmax(score)) if is_numpy(score) else int(_torch().argmax(score).item())
        value = float(score[i])
        if value < 0 or (self.worst is not None and value <= self.worst[0]):
            return
        self.worst = (value, base + i, {k: v[i].item() for k, v in fields.items()})


def _show(acc: _Accumulator, locate: _Locator, line) -> list[str]:
    shown = [f"{locate(flat)}: {line(f)}" for flat, f in acc.examples]
    if acc.worst is not None and acc.worst[1] not in {flat for flat, _ in acc.examples}:
        shown.append(f"worst: {locate(acc.worst[1])}: {line(acc.worst[2])}")
    return shown



def _mask_chunk(mask: Any, locate: _Locator, shape: tuple[int, ...], i: int, j: int, device) -> Any:
    """Rows [i, j) of a bool mask given as a scalar, a full-shape array or a token mask bool[T], flat: numpy where
    `device` is None, else a torch tensor on `device`."""
    if isinstance(mask, (bool, np.bool_)):
        return bool(mask)
    if device is not None and bridge._is_torch_tensor(mask):
        m = mask
        if m.dtype != _torch().bool:
            raise TypeError(f"masks must be bool, got {m.dtype=}")
    else:
        m = np.asarray(bridge.to_numpy(mask))
        if m.dtype != np.bool_:
            raise TypeError(f"masks must be bool, got {m.dtype=}")
    axis = locate.token_axis()
    if tuple(m.shape) == shape:  # copy just the rows (the mask may be a read-only broadcast view)
        rows = m[i:j]
    elif m.ndim == 1 and axis is not None and m.shape[0] == shape[axis]:
        view = [1] * len(shape)
        view[axis] = shape[axis]
        full = m.reshape(view)
        if axis == 0:
            full = full[i:j]
        out = list(shape)
        out[0] = j - i
        rows = np.broadcast_to(full, out) if isinstance(full, np.ndarray) else full.expand(out)
    else:
        raise ValueError(f"mask shape {tuple(m.shape)} is neither the full shape {shape} nor a token mask "
                         f"bool[T] for layout {locate.layout!r}")
    if device is None:
        return np.array(rows).reshape(-1)
    if isinstance(rows, np.ndarray):
        return _torch().from_numpy(np.array(rows)).to(device).reshape(-1)
    return rows.to(device).reshape(-1)
