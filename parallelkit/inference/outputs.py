"""Where a prediction goes: one sample's class map (and softmax), written block by block.

    with writing("zarr", "pred/scan-07", sample, 3, comm, counts=(1, 4, 1),
                 probabilities="float16") as out:     # collective: rank 0 makes the files
        out.write(block, classes_blk, probs_blk)        # every rank: its block

Formats (each lays the data out so that ranks write disjoint parts of it):

    zarr      ``<name>.zarr`` (``.ome.zarr`` for an ``.ome.zarr`` input): an OME-Zarr image
              group, the class map uint8 at level 0, with the input's axes, units, scale and
              translation of the level read, and ``levels`` pyramid levels
              (:mod:`parallelkit.inference.zarr_out`); with probabilities, the group
              ``probabilities`` holds the ``(K, *spatial)`` softmax. The block readers
              (:mod:`parallelkit.data.readers`) read it back as a mask.
    nifti     ``<name>.nii``, the class map uint8, with the input's affine, qform and sform
              codes; ``<name>_probabilities.nii``, a vector image ``(X, Y, Z, 1, K)``
              (:mod:`parallelkit.inference.nifti_out`). Uncompressed: ranks write their
              blocks at fixed offsets into the file.
    nifti.gz  the same, ``.nii.gz``: rank 0 gzips each finished file.
    npy       ``<name>.npy`` (``(*spatial)`` uint8) and ``<name>_probabilities.npy`` (K first).

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

import numpy as np
import torch

from parallelkit.comm import Communicator
from parallelkit.data.arrays import format_of
from parallelkit.data.axes import Block
from parallelkit.data.readers import SampleReader
from parallelkit.inference import nifti_out, zarr_out

FORMATS = ("zarr", "nifti", "nifti.gz", "npy")
SUFFIX = {"zarr": ".zarr", "nifti": ".nii", "nifti.gz": ".nii.gz", "npy": ".npy"}
PACKING = ".packing"
"""A ``.nii.gz`` being compressed: ``.NAME.nii.gz.packing`` (:func:`temp_paths`)."""
PROBABILITIES = "_probabilities"
DEFAULT_CHUNK = {1: 4096, 2: 256, 3: 64}
"""Chunk side where the input has no chunks of its own, by spatial dimensions."""


def stored_dtype(fmt: str, dtype: str) -> str:
    """The dtype the probabilities are stored in: ``dtype``, but float32 in NIfTI for float16
    (NIfTI-1 has no half-precision type)."""
    return "float32" if fmt.startswith("nifti") and dtype == "float16" else dtype


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


def final_paths(fmt: str, base: Path, probabilities: bool, ome: bool = False) -> list[Path]:
    """The files (or zarr group) a sample's prediction ends up as: the class map last, so that
    its presence means the whole prediction is there. ``ome``: the input is ``.ome.zarr``,
    and so is a zarr prediction of it."""
    if fmt not in FORMATS:
        raise ValueError(f"predict.format={fmt!r} must be one of {FORMATS}")
    main = base.with_name(base.name + (".ome" if ome and fmt == "zarr" else "") + SUFFIX[fmt])
    if fmt == "zarr" or not probabilities:
        return [main]
    return [base.with_name(base.name + PROBABILITIES + SUFFIX[fmt]), main]


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is whole."""
    return path.with_name(f".{path.name}.partial")


def temp_paths(fmt: str, finals: Sequence[Path]) -> list[Path]:
    """Every temporary name the prediction ``finals`` may be written under: each file's
    :func:`partial_path`, and for ``nifti.gz`` the gzip stream being made of it."""
    temps = [partial_path(f) for f in finals]
    if fmt == "nifti.gz":
        temps += [f.with_name(f".{f.name}{PACKING}") for f in finals]
    return temps


def is_ome(path: str | Path) -> bool:
    """The input is named ``.ome.zarr``: its zarr prediction keeps that ending."""
    return Path(path).name.lower().endswith(".ome.zarr")


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
    """One sample's prediction files, opened for writing blocks (every rank opens its own).
    ``levels``: its pyramid levels (zarr; 1 otherwise), level ``l`` ``chunks_of[l]``."""

    chunks: tuple[int, ...] | None = None
    levels = 1

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None,
              level: int = 0) -> None:
        """``classes`` ``(*block)`` uint8 and ``probabilities`` ``(K, *block)`` at ``block``."""
        raise NotImplementedError

    def read(self, block: Block, level: int) -> tuple[np.ndarray, np.ndarray | None]:
        """A written block of ``level`` (the pyramid's levels are made from the one above)."""
        raise NotImplementedError

    def level(self, level: int) -> Output:
        """Level ``level`` as an output of its own (its chunks; writes go there)."""
        return _Level(self, level)


class _Level(Output):
    def __init__(self, whole: Output, level: int) -> None:
        self.whole, self.at = whole, level
        self.chunks = getattr(whole, "chunks_of", [whole.chunks])[level]

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None,
              level: int = 0) -> None:
        self.whole.write(block, classes, probabilities, self.at)


def create(fmt: str, paths: Sequence[Path], size: Sequence[int], classes: int,
           probabilities: str | None, reference: SampleReader | None,
           chunks: Sequence[int] | Sequence[Sequence[int]]) -> None:
    """Make the (temporary) files of one prediction, empty: rank 0 of the sample's group.
    ``chunks``: zarr's chunk sides, or a list of them, one per pyramid level."""
    size = tuple(size)
    if fmt == "zarr":
        from parallelkit.data.physical import geometry, plain

        per_level = _per_level(chunks)
        geom = geometry(reference) if reference is not None else plain(len(size))
        zarr_out.create(paths[0], size, classes, probabilities, geom, per_level)
        return
    pairs: list[tuple[Path, tuple[int, ...], str]] = [(paths[-1], size, "uint8")]
    if probabilities:
        shape = ((classes, *size) if fmt == "npy"
                 else nifti_out.probability_shape(size, classes))  # fmt: skip
        pairs.insert(0, (paths[0], shape, probabilities))
    for path, shape, dtype in pairs:
        try:
            if fmt == "npy":
                np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).flush()
            else:
                nifti_out.create_nifti(path, shape, dtype, reference,
                                       vector=shape != size)  # fmt: skip
            allocate(path)
        except OSError as e:
            e.filename = e.filename or str(path)  # for the message: which file
            raise


def _per_level(chunks: Sequence[int] | Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    if chunks and isinstance(chunks[0], int | np.integer):
        return [tuple(int(c) for c in chunks)]  # type: ignore[union-attr]
    return [tuple(c) for c in chunks]  # type: ignore[arg-type]


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


def open_output(fmt: str, paths: Sequence[Path],
                chunks: Sequence[int] | Sequence[Sequence[int]]) -> Output:
    """The files :func:`create` made, opened for writing this rank's blocks."""
    if fmt == "zarr":
        return _ZarrOutput(paths[0], _per_level(chunks))
    return nifti_out.MemmapOutput(fmt, list(paths))


class _ZarrOutput(zarr_out.ZarrLevels, Output):
    def __init__(self, path: Path, chunks: list[tuple[int, ...]]) -> None:
        super().__init__(path)
        self.chunks_of, self.chunks = chunks, chunks[0]


@contextlib.contextmanager
def writing(fmt: str, base: str | Path, sample: SampleReader, classes: int, comm: Communicator,
            counts: Sequence[int], probabilities: str | None = None,
            begin: Callable[[list[Path]], None] | None = None,
            levels: int = 1) -> Iterator[Output]:
    """One sample's prediction, written by every rank of ``comm`` (collective)::

        with writing("zarr", "out/scan-07", sample, 3, comm, counts) as out:
            predictor(sample, out)                      # each rank writes its block

    Rank 0 makes the files under temporary names (:func:`temp_paths`), chunked for a
    sample split in ``counts`` blocks per dimension (:func:`chunking`, the input's chunks
    where it has them); when every rank has written, rank 0 flushes them (gzips them, for
    ``nifti.gz``) and renames them into place, so a final name always holds a whole
    prediction. ``probabilities``: also write the softmax, in this dtype (``"float16"``,
    ``"float32"``; float16 is stored as float32 in NIfTI). ``levels``: zarr pyramid levels
    (the predictor writes levels 1, 2, ... once level 0 is whole). ``begin``: called on rank
    0 with every path the prediction may make, before any is made (``parallelkit predict``
    records them). A write error: :class:`WriteError` on every rank (the module's
    docstring), and none of the prediction's files left.
    """
    finals = final_paths(fmt, Path(base), probabilities is not None, is_ome(sample.path))
    every = temp_paths(fmt, finals)
    temps = every[:len(finals)]
    if probabilities:
        probabilities = stored_dtype(fmt, probabilities)
    preferred = input_chunks(sample)
    chunks = [chunking(s, counts, preferred) for s in zarr_out.level_sizes(
        sample.size, levels if fmt == "zarr" else 1)]  # fmt: skip
    problem, at = "", finals[-1]
    if comm.rank == 0:
        try:
            if begin is not None:
                begin([*finals, *every])
            for t in every:
                remove(t)
            create(fmt, temps, sample.size, classes, probabilities, sample, chunks)
        except OSError as e:
            problem = describe(e, _final_of(e, fmt, finals, at))
    _settle(comm, problem, every)
    output = _Guarded(fmt, temps, finals, chunks)
    yield output
    _settle(comm, output.problem, every)
    if comm.rank == 0:
        try:
            for t, at in zip(temps, finals, strict=True):
                fsync_tree(t)
                remove(at)
                if fmt == "nifti.gz":
                    nifti_out.compress(t, every[len(finals) + finals.index(at)], at)
                else:
                    t.rename(at)
        except OSError as e:
            problem = describe(e, at)
    _settle(comm, problem, [*every, *finals])


def _final_of(error: OSError, fmt: str, finals: list[Path], default: Path) -> Path:
    """The final name of the temporary file an error names, the file it names when that is
    none of them (a record), else ``default``."""
    if not error.filename:
        return default
    named = Path(error.filename)
    for f in finals:
        for t in temp_paths(fmt, [f]):
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
                 chunks: list[tuple[int, ...]]) -> None:
        self.problem, self.finals, self.fmt = "", finals, fmt
        self.chunks = tuple(chunks[0]) if fmt == "zarr" else None
        self.chunks_of, self.levels = chunks, len(chunks) if fmt == "zarr" else 1
        self.inner: Output | None = None
        try:
            self.inner = open_output(fmt, temps, chunks)
        except OSError as e:
            self.problem = describe(e, _final_of(e, fmt, finals, finals[-1]))

    def write(self, block: Block, classes: np.ndarray, probabilities: np.ndarray | None,
              level: int = 0) -> None:
        if self.inner is None or self.problem:
            return
        try:
            self.inner.write(block, classes, probabilities, level)
        except OSError as e:
            self.problem = describe(e, _final_of(e, self.fmt, self.finals, self.finals[-1]))

    def read(self, block: Block, level: int) -> tuple[np.ndarray, np.ndarray | None]:
        shape = tuple(s.stop - s.start for s in block)
        if self.inner is not None and not self.problem:
            try:
                return self.inner.read(block, level)
            except OSError as e:
                self.problem = describe(e, _final_of(e, self.fmt, self.finals, self.finals[-1]))
        return np.zeros(shape, np.uint8), None  # skipped: the sample ends in a WriteError


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


def fsync_tree(path: Path) -> None:
    """Flush a written prediction to disk before it is renamed into place."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
