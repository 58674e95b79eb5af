"""Rank-side cases for whole-sample prediction (:class:`parallelkit.inference.Predictor`).

``predict_parity`` predicts one sample on a grid, in float64, written by every rank into its
block of the output file (zarr with small chunks, npy or NIfTI), and rank 0 of each spatial
group compares the file with the dense model run on the whole sample: softmax within float64
roundoff, class maps identical wherever the two best classes are not tied. Samples of sizes
the model cannot take whole are padded at their far end (the same on one rank and many).
The networks are those of :mod:`blocks_cases`: convolutions (strided too), BatchNorm with
running statistics, pooling, a transposed convolution, upsampling and a skip connection.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import torch

import parallelkit as pk
import parallelkit.functional as pkf
from parallelkit.comm import Communicator
from parallelkit.data.readers import SampleReader
from parallelkit.inference import Predictor, create, open_output
from parallelkit.inference.outputs import final_paths
from parallelkit.spatial import edges as spatial_edges

from blocks_cases import NETS


def dense_net(net: str) -> torch.nn.Module:
    """The network in float64, with BatchNorm running statistics that are not the defaults."""
    torch.manual_seed(0)
    dense = NETS[net][0]().double().eval()
    gen = torch.Generator().manual_seed(5)
    for m in dense.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen, dtype=torch.float64))
            m.running_var.copy_(torch.rand(m.num_features, generator=gen, dtype=torch.float64) + .5)
    return dense


def write_input(path: Path, x: np.ndarray, chunks: tuple[int, ...] | None) -> None:
    """``x`` (C, *spatial) as npy, or as a zarr array with ``chunks`` (C first)."""
    if path.suffix == ".zarr":
        import zarr

        a = zarr.open_array(str(path), mode="w", shape=x.shape, dtype=x.dtype,
                            chunks=(x.shape[0], *chunks))
        a[...] = x
    else:
        np.save(path, x)


@contextlib.contextmanager
def halo_off():
    """The negative control: every rank fetches only its own rows (the others' as zeros) and
    the edge path adds no halo terms, so each block is convolved alone."""
    gather_rows, add_terms = pkf.gather_rows, spatial_edges.add_halo_terms

    def own_rows(x, comm, dim, sizes, want, fill=0.0):
        start = sum(sizes[: comm.rank])
        lo, hi = want[comm.rank]
        out = x.new_full((*x.shape[:dim], hi - lo, *x.shape[dim + 1 :]), fill)
        a, b = max(lo, start), min(hi, start + sizes[comm.rank])
        if a < b:
            out.narrow(dim, a - lo, b - a).copy_(x.narrow(dim, a - start, b - a))
        return out

    pkf.gather_rows, spatial_edges.add_halo_terms = own_rows, lambda y, *_: y
    try:
        yield
    finally:
        pkf.gather_rows, spatial_edges.add_halo_terms = gather_rows, add_terms


def predict_parity(comm: Communicator, tmp: str, net: str, grid: dict, size: tuple,
                   fmt: str, source: str = "npy", chunks: tuple[int, ...] | None = None,
                   tamper: bool = False) -> list:
    """(label, got, expected) triples on rank 0 of each spatial group; [] elsewhere."""
    dense = dense_net(net)
    channels = NETS[net][1][0]
    g = pk.Grid(comm, **grid)
    root = Path(tmp)
    sample_path = root / f"input.{source}"
    x = torch.randn(channels, *size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(3)).numpy()
    if comm.rank == 0:
        write_input(sample_path, x, chunks)
    comm.barrier()
    sample = SampleReader(sample_path, dims=len(size))
    predictor = Predictor(dense, g, dtype=torch.float64)
    run = predictor.padded(size, channels)
    out = final_paths(fmt, root / f"out-{g.coords[0]}" / "pred", probabilities=True)
    first = g.spatial_comm.rank == 0
    if first:
        out[0].parent.mkdir(exist_ok=True)
        create(fmt, out, size, channels, "float64", sample, chunks or (4,) * len(size))
    g.spatial_comm.barrier()
    output = open_output(fmt, out, chunks or (4,) * len(size))
    with halo_off() if tamper else contextlib.nullcontext():
        predictor(sample, output, probabilities=True)
    g.spatial_comm.barrier()
    if not first:
        return []
    padded = torch.zeros(1, channels, *run, dtype=torch.float64)
    padded[(0, slice(None), *(slice(0, n) for n in size))] = torch.from_numpy(x)
    with torch.no_grad():
        logits = copy.deepcopy(dense)(padded)[(0, slice(None), *(slice(0, n) for n in size))]
    want = logits.softmax(0)
    got_probs, got_classes = read_output(fmt, out, channels)
    top2 = want.topk(2, 0).values
    clear = (top2[0] - top2[1]) > 1e-9
    return [
        ("probabilities", got_probs, want),
        ("classes (no ties)", got_classes[clear], want.argmax(0)[clear]),
    ]


def read_output(fmt: str, paths: list[Path], channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax (K, *spatial) float64, class map (*spatial) int64) from a written prediction."""
    if fmt == "zarr":
        import zarr

        root = zarr.open_group(str(paths[0]), mode="r")
        probs, classes = root["probabilities/0"][...], root["0"][...]
    elif fmt == "npy":
        probs, classes = np.load(paths[0]), np.load(paths[1])
    else:
        import nibabel as nib

        classes = np.asarray(nib.load(str(paths[1])).dataobj)
        vector = np.asarray(nib.load(str(paths[0])).dataobj)  # (X, Y, Z, 1, K)
        probs = np.moveaxis(vector.reshape(*classes.shape, vector.shape[-1]), -1, 0)
    return torch.from_numpy(np.array(probs)), torch.from_numpy(np.array(classes)).long()


def largest_in_prediction(comm: Communicator, tmp: str, net: str, grid: dict, size: tuple,
                          ) -> tuple[int, str, int]:
    """(the largest tensor that predicting one sample creates on this rank, the operation that
    made it, one whole sample's elements), reading from and writing to disk."""
    from blocks_cases import _Largest

    dense = dense_net(net).float()
    channels = NETS[net][1][0]
    root = Path(tmp)
    if comm.rank == 0:
        np.save(root / "input.npy", np.random.default_rng(0).random((channels, *size), np.float32))
    comm.barrier()
    sample = SampleReader(root / "input.npy", dims=len(size))
    g = pk.Grid(comm, **grid)
    predictor = Predictor(dense, g)
    out = final_paths("npy", root / "pred", probabilities=True)
    if comm.rank == 0:
        create("npy", out, size, channels, "float32", sample, (1,) * len(size))
    comm.barrier()
    output = open_output("npy", out, (1,) * len(size))
    predictor.padded(size, channels)  # the meta-device trial runs before the record
    with _Largest() as seen:
        predictor(sample, output, probabilities=True)
    return seen.largest, seen.op, channels * int(np.prod(size))
