"""Where a prediction goes: one sample's class map (and softmax), written block by block.

    with writing("zarr", "pred/scan-07", sample, 3, comm, counts=(1, 4, 1),
                 probabilities="float16") as out:     # collective: rank 0 makes the files
        out.write(block, classes_blk, probs_blk)        # every rank: its block

Formats (each lays the data out so that ranks write disjoint parts of it):

    zarr    ``<name>.zarr``: an OME-Zarr image group whose level 0 (array ``0``) is the class
            map, uint8, with the input's spatial axes and scale where the input is OME-Zarr;
            with probabilities, the group ``probabilities`` holds a ``(K, *spatial)`` softmax.
            The block readers (:mod:`parallelkit.data.readers`) read it back as a mask.
    nifti   ``<name>.nii``: the class map, uint8, with the input's affine where the input is
            NIfTI; ``<name>_probabilities.nii``: ``(X, Y, Z, K)``. Uncompressed, because ranks
            write their blocks at fixed offsets into the file (a .nii.gz cannot be written in
            parts).
    npy     ``<name>.npy`` (``(*spatial)`` uint8) and ``<name>_probabilities.npy`` (K first).

Why chunks matter. A zarr chunk is written whole: two ranks writing parts of one chunk at
once would each read, modify and write it, and one would lose. So :attr:`Output.chunks` says
how the file is cut, and the writer (:mod:`parallelkit.inference.predictor`) writes the
chunks wholly inside its block at once and the parts of shared chunks in turns. Chunks along
a split dimension are never larger than the smallest block (:func:`chunking`), so only
neighbouring blocks share a chunk. Memory-mapped formats have no chunks: ``chunks`` is None.

Every file is made under a temporary name (:func:`partial_path`) and renamed into place when
every rank has written its block, so a name in the output folder is a whole prediction.

Write errors. npy and NIfTI files are allocated whole when made (``posix_fallocate``): a full
disk is then an ``OSError`` at creation, not a ``SIGBUS`` in the middle of a memory-mapped
write. Any ``OSError`` while making, writing or renaming a prediction (full disk, ``ulimit
-f``, read-only file system) is caught where it happens, the ranks of the sample's group
learn of it at the next step they share anyway, rank 0 removes the prediction's files, and
every rank raises :class:`WriteError`, one line naming the file, said by the rank that saw it.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallelkit.comm import Communicator
from parallelkit.data.readers import Block, SampleReader, format_of

FORMATS = ("zarr", "nifti", "npy")
SUFFIX = {"zarr": ".zarr", "nifti": ".nii", "npy": ".npy"}
PROBABILITIES = "_probabilities"
DEFAULT_CHUNK = {1: 4096, 2: 256, 3: 64}
"""Chunk side where the input has no chunks of its own, by spatial dimensions."""


def stored_dtype(fmt: str, dtype: str) -> str:
    """The dtype the probabilities are stored in: ``dtype``, but float32 in NIfTI for float16
    (NIfTI-1 has no half-precision type)."""
    return "float32" if fmt == "nifti" and dtype == "float16" else dtype


def output_bytes(size: Sequence[int], classes: int, probabilities: str | None) -> int:
    """Bytes of one prediction, uncompressed: the uint8 class map, and the softmax in the
    dtype ``probabilities`` (None: none)."""
    n = math.prod(size)
    return n + (n * classes * np.dtype(probabilities).itemsize if probabilities else 0)


class WriteError(Exception):
    """A prediction could not be written; raised on every rank of the sample's group. Its
    message (one line, naming the file) is set on the rank that saw the error, '' elsewhere."""


HINTS = {
    errno.ENOSPC: "the file system is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "larger than this process may write: ulimit -f",
    errno.EROFS: "a read-only file system",
    errno.EACCES: "not writable by this user",
    errno.EPERM: "not writable by this user",
}


def describe(error: OSError, path: Path) -> str:
    """``could not write PATH: <reason> (<hint>)``: one line."""
    hint = HINTS.get(error.errno or 0)
    return (f"could not write {path}: {error.strerror or error}"
            + (f" ({hint})" if hint else "") + "; the prediction's partial files are removed")


def final_paths(fmt: str, base: Path, probabilities: bool) -> list[Path]:
    """The files (or zarr group) a sample's prediction ends up as: the class map last, so that
    its presence means the whole prediction is there."""
    if fmt not in FORMATS:
        raise ValueError(f"predict.format={fmt!r} must be one of {FORMATS}")
    main = base.with_name(base.name + SUFFIX[fmt])
    if fmt == "zarr" or not probabilities:
        return [main]
    return [base.with_name(base.name + PROBABILITIES + SUFFIX[fmt]), main]


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is whole."""
    return path.with_name(f".{path.name}.partial")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def chunking(size: Sequence[int], counts: Sequence[int], preferred: Sequence[int] | None,
             ) -> tuple[int, ...]:
    """Chunk sides for a sample of ``size`` split in ``counts`` blocks per dimension: the
    ``preferred`` ones (the input's), or :data:`DEFAULT_CHUNK`, but never larger than the
    smallest block along a split dimension (see the module's docstring)."""
    default = DEFAULT_CHUNK.get(len(size), 64)
    out = []
    for d, (n, parts) in enumerate(zip(size, counts, strict=True)):
        c = int(preferred[d]) if preferred else default
        smallest = n // parts  # tensor_split: the last blocks are the smaller ones
        out.append(max(1, min(c, n, smallest if parts > 1 else n)))
    return tuple(out)


class Output:
    """One sample's prediction files, opened for writing blocks (every rank opens its own)."""

    chunks: tuple[int, ...] | None = None

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None) -> None:
        """``classes`` ``(*block)`` uint8 and ``probabilities`` ``(K, *block)`` at ``block``."""
        raise NotImplementedError


def create(fmt: str, paths: Sequence[Path], size: Sequence[int], classes: int,
           probabilities: str | None, reference: SampleReader | None,
           chunks: Sequence[int]) -> None:
    """Make the (temporary) files of one prediction, empty: rank 0 of the sample's group."""
    size = tuple(size)
    if fmt == "zarr":
        _create_zarr(paths[0], size, classes, probabilities, reference, tuple(chunks))
        return
    pairs: list[tuple[Path, tuple[int, ...], str]] = [(paths[-1], size, "uint8")]
    if probabilities:
        shape = (classes, *size) if fmt == "npy" else (*size, classes)  # NIfTI: (X, Y, Z, K)
        pairs.insert(0, (paths[0], shape, probabilities))
    for path, shape, dtype in pairs:
        try:
            if fmt == "npy":
                np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
            else:
                _create_nifti(path, shape, dtype, reference)
            allocate(path)
        except OSError as e:
            e.filename = e.filename or str(path)  # for the message: which file
            raise


def allocate(path: Path) -> None:
    """Give ``path`` its disk blocks now, so that a full disk fails here (ENOSPC) rather than
    as a SIGBUS when a memory map first touches a page; file systems that cannot allocate
    ahead (some network ones) keep a sparse file."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
    finally:
        os.close(fd)


def open_output(fmt: str, paths: Sequence[Path], chunks: Sequence[int]) -> Output:
    """The files :func:`create` made, opened for writing this rank's blocks."""
    if fmt == "zarr":
        return _ZarrOutput(paths[0], tuple(chunks))
    return _MemmapOutput(fmt, list(paths))


@contextlib.contextmanager
def writing(fmt: str, base: str | Path, sample: SampleReader, classes: int, comm: Communicator,
            counts: Sequence[int], probabilities: str | None = None,
            begin: Callable[[list[Path]], None] | None = None) -> Iterator[Output]:
    """One sample's prediction, written by every rank of ``comm`` (collective)::

        with writing("zarr", "out/scan-07", sample, 3, comm, counts) as out:
            predictor(sample, out)                      # each rank writes its block

    Rank 0 makes the files under temporary names (:func:`partial_path`), chunked for a
    sample split in ``counts`` blocks per dimension (:func:`chunking`, the input's chunks
    where it has them); when every rank has written, rank 0 flushes them and renames them into
    place, so a final name always holds a whole prediction. ``probabilities``: also write the
    softmax, in this dtype (``"float16"``, ``"float32"``; float16 is stored as float32 in
    NIfTI). ``begin``: called on rank 0 with every path the prediction may make, before any
    is made (``parallelkit predict`` records them). A write error: :class:`WriteError` on
    every rank (the module's docstring), and none of the prediction's files left.
    """
    finals = final_paths(fmt, Path(base), probabilities is not None)
    temps = [partial_path(f) for f in finals]
    if probabilities:
        probabilities = stored_dtype(fmt, probabilities)
    chunks = chunking(sample.size, counts, input_chunks(sample))
    problem, at = "", finals[-1]
    if comm.rank == 0:
        try:
            if begin is not None:
                begin([*finals, *temps])
            for t in temps:
                remove(t)
            create(fmt, temps, sample.size, classes, probabilities, sample, chunks)
        except OSError as e:
            problem = describe(e, _final_of(e, temps, finals, at))
    _settle(comm, problem, temps)
    output = _Guarded(fmt, temps, finals, chunks)
    yield output
    _settle(comm, output.problem, temps)
    if comm.rank == 0:
        try:
            for t, at in zip(temps, finals, strict=True):
                fsync_tree(t)
                remove(at)
                t.rename(at)
        except OSError as e:
            problem = describe(e, at)
    _settle(comm, problem, [*temps, *finals])


def _final_of(error: OSError, temps: list[Path], finals: list[Path], default: Path) -> Path:
    """The final name of the temporary file an error names, the file it names when that is
    none of them (a record), else ``default``."""
    if not error.filename:
        return default
    named = Path(error.filename)
    for t, f in zip(temps, finals, strict=True):
        if named == t or t in named.parents:
            return f
    return named


def _settle(comm: Communicator, problem: str, made: Sequence[Path]) -> None:
    """Collective over ``comm`` (it replaces a barrier): when any rank has a ``problem``,
    rank 0 removes ``made`` and every rank raises :class:`WriteError`."""
    device = comm.device if comm.device is not None else torch.device("cpu")
    flag = torch.tensor([1.0 if problem else 0.0], device=device)
    if comm.all_reduce(flag, "max").item() > 0:
        if comm.rank == 0:
            for p in made:
                with contextlib.suppress(OSError):
                    remove(p)
        raise WriteError(problem)


class _Guarded(Output):
    """The opened files; an ``OSError`` in opening or writing is kept in :attr:`problem`
    (later blocks are skipped), so that this rank still joins its group's collectives."""

    def __init__(self, fmt: str, temps: list[Path], finals: list[Path],
                 chunks: Sequence[int]) -> None:
        self.problem, self.finals = "", finals
        self.chunks = tuple(chunks) if fmt == "zarr" else None
        self.inner: Output | None = None
        try:
            self.inner = open_output(fmt, temps, chunks)
        except OSError as e:
            self.problem = describe(e, _final_of(e, temps, finals, finals[-1]))
        self.temps = temps

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None) -> None:
        if self.inner is None or self.problem:
            return
        try:
            self.inner.write(block, classes, probabilities)
        except OSError as e:
            self.problem = describe(e, _final_of(e, self.temps, self.finals, self.finals[-1]))


def input_chunks(reader: SampleReader) -> tuple[int, ...] | None:
    """The input's chunk sides along its spatial axes (zarr), else None."""
    if format_of(reader.path) != "zarr":
        return None
    import zarr

    node = zarr.open(reader.path, mode="r")
    if isinstance(node, zarr.Group):
        attrs = dict(node.attrs)
        scales = attrs.get("ome", {}).get("multiscales") or attrs.get("multiscales")
        node = node[scales[0]["datasets"][0]["path"]]
    return tuple(node.chunks[i] for i in reader.layout.spatial)


# ----------------------------------------------------------------------------- zarr
def _ome_axes(reference: SampleReader | None, ndim: int) -> tuple[list[dict], list[float]]:
    """The spatial axes (names, units) and level-0 scale of the input where it is OME-Zarr;
    otherwise ``z, y, x`` (the last ``ndim``) with a scale of 1."""
    names = ["z", "y", "x"][3 - ndim:] if ndim <= 3 else [f"s{i}" for i in range(ndim)]
    axes: list[dict] = [{"name": n, "type": "space"} for n in names]
    scale = [1.0] * ndim
    if reference is None or format_of(reference.path) != "zarr":
        return axes, scale
    import zarr

    node = zarr.open(reference.path, mode="r")
    if not isinstance(node, zarr.Group):
        return axes, scale
    attrs = dict(node.attrs)
    multiscale = (attrs.get("ome", {}).get("multiscales") or attrs.get("multiscales") or [{}])[0]
    given = multiscale.get("axes")
    if isinstance(given, list) and len(given) == len(reference.shape):
        axes = [given[i] if isinstance(given[i], dict) else {"name": given[i]}
                for i in reference.layout.spatial]
    for t in (multiscale.get("datasets") or [{}])[0].get("coordinateTransformations", []):
        if t.get("type") == "scale" and len(t.get("scale", [])) == len(reference.shape):
            scale = [float(t["scale"][i]) for i in reference.layout.spatial]
    return axes, scale


def _multiscales(name: str, axes: list[dict], scale: list[float]) -> dict[str, Any]:
    return {"ome": {"version": "0.5", "multiscales": [{
        "name": name, "axes": axes,
        "datasets": [{"path": "0", "coordinateTransformations": [
            {"type": "scale", "scale": scale}]}],
    }]}}  # fmt: skip


def _create_zarr(path: Path, size: tuple[int, ...], classes: int, probabilities: str | None,
                 reference: SampleReader | None, chunks: tuple[int, ...]) -> None:
    import zarr

    axes, scale = _ome_axes(reference, len(size))
    root = zarr.open_group(str(path), mode="w", zarr_format=3)
    root.attrs.update(_multiscales("classes", axes, scale))
    root.create_array("0", shape=size, chunks=chunks, dtype="uint8", fill_value=0)
    if probabilities:
        group = root.create_group("probabilities")
        channel = [{"name": "c", "type": "channel"}]
        group.attrs.update(_multiscales("probabilities", [*channel, *axes], [1.0, *scale]))
        group.create_array("0", shape=(classes, *size), chunks=(classes, *chunks),
                           dtype=probabilities, fill_value=0)


class _ZarrOutput(Output):
    def __init__(self, path: Path, chunks: tuple[int, ...]) -> None:
        import zarr

        root = zarr.open_group(str(path), mode="r+")
        self.classes = root["0"]
        self.probabilities = root["probabilities/0"] if "probabilities" in root else None
        self.chunks = chunks

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None) -> None:
        self.classes[block] = classes
        if self.probabilities is not None and probabilities is not None:
            self.probabilities[(slice(None), *block)] = probabilities


# --------------------------------------------------------------------- NIfTI and npy
NIFTI_OFFSET = 352
"""A single-file NIfTI-1's header (348 bytes) and its empty extension flag (4 bytes)."""


def _create_nifti(path: Path, shape: tuple[int, ...], dtype: str,
                  reference: SampleReader | None) -> None:
    """An uncompressed ``.nii`` of ``shape``, zero-filled, with the input's affine (and voxel
    sizes) where the input is NIfTI; the data start at :data:`NIFTI_OFFSET`."""
    import nibabel as nib

    header = nib.Nifti1Header()
    affine = np.eye(4)
    if reference is not None and format_of(reference.path) == "nifti":
        source = nib.load(str(reference.path))
        affine = source.affine
        header.set_xyzt_units(*source.header.get_xyzt_units())
    header.set_data_shape(shape)
    header.set_data_dtype(np.dtype(dtype))
    header.set_sform(affine, code=1)
    header.set_qform(affine, code=1)
    header["vox_offset"] = NIFTI_OFFSET
    header["scl_slope"], header["scl_inter"] = 1.0, 0.0
    with open(path, "wb") as f:
        header.write_to(f)
        f.write(b"\x00" * (NIFTI_OFFSET - f.tell()))
        f.truncate(NIFTI_OFFSET + math.prod(shape) * np.dtype(dtype).itemsize)


class _MemmapOutput(Output):
    """npy (C order, channels first) or NIfTI (Fortran order, channels last) files, mapped."""

    def __init__(self, fmt: str, paths: list[Path]) -> None:
        self.fmt = fmt
        self.maps = [self._map(p) for p in paths]

    def _map(self, path: Path) -> np.memmap:
        if self.fmt == "npy":
            return np.load(path, mmap_mode="r+")
        import nibabel as nib

        with open(path, "rb") as f:  # by its header: a temporary name has no .nii to go by
            header = nib.Nifti1Header.from_fileobj(f)
        return np.memmap(path, dtype=header.get_data_dtype(), mode="r+", offset=NIFTI_OFFSET,
                         shape=header.get_data_shape(), order="F")

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None) -> None:
        self.maps[-1][block] = classes
        if len(self.maps) == 2 and probabilities is not None:
            if self.fmt == "nifti":  # (X, Y, Z, K): channels last
                self.maps[0][(*block, slice(None))] = np.moveaxis(probabilities, 0, -1)
            else:
                self.maps[0][(slice(None), *block)] = probabilities
        for m in self.maps:
            m.flush()


def fsync_tree(path: Path) -> None:
    """Flush a written prediction to disk before it is renamed into place."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
