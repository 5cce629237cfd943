"""scripts/n_stream.py's simplified three-pass merges (a GPU diagnostic, docs/design.md "What the large-N merge
still waits for") measure what they claim: a program of several tiles that overlaps the next tile's maximum and sum
with this tile's weighted sum, and a split into a maximum-and-sum kernel and a weighted-sum kernel, give the one-tile
program's bits, and all are the float64 merge to f32 rounding.
Triton's interpreter on a CPU, compiled on a GPU."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import n_stream  # noqa: E402


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(n_stream, "H", 4)
    monkeypatch.setattr(n_stream, "D", 16)
    g = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outs = torch.randn(32, 16, 4, 16, generator=g).to(device)
    lses = (torch.randn(32, 4, 16, generator=g) * 3).to(device)
    return outs, lses


def test_overlapped_passes_keep_the_bits_and_the_merge(small):
    outs, lses = small
    lse = lses.double()
    e = torch.exp(lse - lse.max(0).values)
    want = (outs.double() * (e / e.sum(0)).permute(0, 2, 1)[..., None]).sum(0)
    mz = torch.stack([lses.max(0).values, e.sum(0).float()])
    got = {}
    for tiles_per_program, mode in ((1, ""), (2, ""), (4, ""), (1, "split"), (1, "given")):
        out = torch.zeros_like(outs[0])
        n_stream.passes(out, outs, lses, mz.clone(), (tiles_per_program, 8, 8, 2, mode), evict="")
        got[tiles_per_program, mode] = out
        assert (out.double() - want).abs().max().item() < 1e-5
    assert all(torch.equal(got[1, ""], got[key]) for key in ((2, ""), (4, ""), (1, "split")))
