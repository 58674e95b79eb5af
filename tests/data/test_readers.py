"""Block readers (parallelkit.data.readers) and the block data set (parallelkit.data.blockset).

Small files are written in each format with its own package; every rank's block, for grids of
1-4 ranks with uneven splits, 2-D and 3-D, must equal the same slices of a whole read. A
spatial group's ranks are simulated in one process: each rank's block is the
``torch.tensor_split`` layout (``parallelkit.geometry.blocks``) that its ``BlockLayout`` (and
``SpatialGrid.block``) gives, and the blocks of every rank, put together, must make the whole
(cropped, flipped) sample.
"""

from __future__ import annotations

import itertools
import json
import pickle

import numpy as np
import pytest
import torch

from parallelkit.data import blockset
from parallelkit.data.blockset import BlockDataset, View, channel_stats, draw_view
from parallelkit.data.readers import Layout, SampleReader, open_array
from parallelkit.geometry import BlockLayout, blocks

zarr = pytest.importorskip("zarr")
tifffile = pytest.importorskip("tifffile")
nib = pytest.importorskip("nibabel")

GRIDS_2D = [(1, 1), (2, 1), (1, 2), (3, 1), (2, 2), (1, 3), (1, 4), (4, 1)]
GRIDS_3D = [(2, 1, 1), (1, 2, 2), (2, 2, 1), (1, 1, 3), (1, 3, 1)]
SIZE_2D, SIZE_3D = (37, 23), (7, 11, 9)  # nothing divides evenly


def rank_blocks(size, counts):
    """Every rank's block of a sample of ``size`` over a grid of ``counts``, in rank order."""
    per_dim = [[slice(a, b) for a, b in blocks(n, p)] for n, p in zip(size, counts, strict=True)]
    return list(itertools.product(*per_dim))


def assemble(parts, counts):
    """The whole array from every rank's block (rank order), blocks over the last dims."""
    nd = len(counts)
    parts = [np.asarray(p) for p in parts]

    def join(chunk, dim):
        if dim == nd:
            return chunk[0]
        step = len(chunk) // counts[dim]
        pieces = [join(chunk[i * step:(i + 1) * step], dim + 1) for i in range(counts[dim])]
        return np.concatenate(pieces, axis=dim - nd)

    return join(parts, 0)


def test_rank_blocks_are_tensor_split():
    x = torch.arange(np.prod(SIZE_3D)).reshape(SIZE_3D)
    for counts in GRIDS_3D:
        want = [
            c
            for a in torch.tensor_split(x, counts[0], 0)
            for b in torch.tensor_split(a, counts[1], 1)
            for c in torch.tensor_split(b, counts[2], 2)
        ]
        got = [x[s] for s in rank_blocks(SIZE_3D, counts)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        coords = itertools.product(*[range(p) for p in counts])  # rank order
        mine = [x[BlockLayout(counts, c).slices(*SIZE_3D)] for c in coords]
        assert all(torch.equal(a, b) for a, b in zip(mine, got, strict=True))
        assert np.array_equal(assemble(got, counts), x.numpy())


# ------------------------------------------------------------------------ files, per format
def rng_array(shape, dtype=np.uint16, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, shape).astype(dtype)


def write_npy(path, a):
    np.save(path, a)


def write_zarr(path, a, chunks=None, zarr_format=3):
    z = zarr.create_array(path, shape=a.shape, dtype=a.dtype, chunks=chunks or (5,) * a.ndim,
                          zarr_format=zarr_format)
    z[...] = a


def write_ome_zarr(path, a, axes, zarr_format=3):
    """An OME-Zarr image: level 0 ``a``, level 1 halved along the spatial axes (2 levels)."""
    g = zarr.open_group(path, mode="w", zarr_format=zarr_format)
    down = tuple(slice(None, None, 2) if k == "space" else slice(None) for k in axes.values())
    for name, level in (("s0", a), ("s1", a[down])):
        array = g.create_array(name, shape=level.shape, dtype=level.dtype, chunks=(4,) * a.ndim)
        array[...] = level
    scales = [{"axes": [{"name": n, "type": t} for n, t in axes.items()],
               "datasets": [{"path": "s0"}, {"path": "s1"}], "version": "0.4"}]
    if zarr_format == 3:
        g.attrs["ome"] = {"version": "0.5", "multiscales": scales}
    else:
        g.attrs["multiscales"] = scales


def write_tiff(path, a, **kw):
    tifffile.imwrite(path, a, **kw)


def write_pyramid(path, a, **kw):
    """An OME-TIFF of 2 levels (level 1 in a SubIFD), tiled RGB."""
    with tifffile.TiffWriter(path) as tif:
        tif.write(a, subifds=1, tile=(16, 16), photometric="rgb", **kw)
        tif.write(a[::2, ::2], subfiletype=1, tile=(16, 16), photometric="rgb", **kw)


def write_nifti(path, a):
    nib.save(nib.Nifti1Image(a, np.eye(4)), path)


# (name, dims, filename, stored array's shape, writer, stored -> (C, *spatial))
def chw(a):
    return a


def hwc(a):
    return np.moveaxis(a, -1, 0)


def one(a):
    return a[None]


TCZYX = {"t": "time", "c": "channel", "z": "space", "y": "space", "x": "space"}
CASES = [
    ("npy HW", 2, "x.npy", SIZE_2D, write_npy, one),
    ("npy CHW", 2, "x.npy", (3, *SIZE_2D), write_npy, chw),
    ("npy HWC", 2, "x.npy", (*SIZE_2D, 3), write_npy, hwc),
    ("npy DHW", 3, "x.npy", SIZE_3D, write_npy, one),
    ("npy CDHW", 3, "x.npy", (2, *SIZE_3D), write_npy, chw),
    ("zarr CHW", 2, "x.zarr", (2, *SIZE_2D), write_zarr, chw),
    ("zarr HW v2 format", 2, "x.zarr", SIZE_2D,
     lambda p, a: write_zarr(p, a, zarr_format=2), one),
    ("zarr DHW", 3, "x.zarr", SIZE_3D, write_zarr, one),
    ("ome-zarr cyx", 2, "x.ome.zarr", (2, *SIZE_2D),
     lambda p, a: write_ome_zarr(p, a, {"c": "channel", "y": "space", "x": "space"}), chw),
    ("ome-zarr tczyx z=1 v2 format", 2, "x.ome.zarr", (1, 3, 1, *SIZE_2D),
     lambda p, a: write_ome_zarr(p, a, TCZYX,
                                 zarr_format=2), lambda a: a[0, :, 0]),
    ("ome-zarr zyx", 3, "x.ome.zarr", SIZE_3D,
     lambda p, a: write_ome_zarr(p, a, {"z": "space", "y": "space", "x": "space"}), one),
    ("tiff tiled zlib gray", 2, "x.tif", SIZE_2D,
     lambda p, a: write_tiff(p, a, tile=(16, 16), compression="zlib"), one),
    ("tiff tiled raw rgb", 2, "x.tif", (*SIZE_2D, 3),
     lambda p, a: write_tiff(p, a, tile=(16, 16), photometric="rgb"), hwc),
    ("tiff striped raw rgb", 2, "x.tiff", (*SIZE_2D, 3),
     lambda p, a: write_tiff(p, a, rowsperstrip=5, photometric="rgb"), hwc),
    ("tiff striped zlib planar", 2, "x.tif", (3, *SIZE_2D),
     lambda p, a: write_tiff(p, a, rowsperstrip=5, compression="zlib",
                             photometric="rgb", planarconfig="separate"), chw),
    ("ome-tiff pyramid zlib rgb", 2, "x.ome.tif", (*SIZE_2D, 3),
     lambda p, a: write_pyramid(p, a, compression="zlib"), hwc),
    ("tiff pages DHW", 3, "x.tif", SIZE_3D, write_tiff, one),
    ("tiff tiled zlib DHW", 3, "x.tif", SIZE_3D,
     lambda p, a: write_tiff(p, a, tile=(16, 16), compression="zlib"), one),
    ("nifti XYZ", 3, "x.nii", SIZE_3D, write_nifti, one),
    ("nifti XYZC gz", 3, "x.nii.gz", (*SIZE_3D, 2), write_nifti, hwc),
]
MEMMAPPED = {"npy HW", "npy CHW", "npy HWC", "npy DHW", "npy CDHW", "tiff striped raw rgb",
             "tiff pages DHW"}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_rank_reads_its_block_of_the_whole(case, tmp_path):
    name, dims, filename, shape, write, canonical = case
    stored = rng_array(shape, np.uint8 if "rgb" in name else np.uint16)
    path = tmp_path / filename
    write(path, stored)
    whole = canonical(stored)
    reader = SampleReader(path, dims)
    assert (reader.channels, *reader.size) == whole.shape
    assert reader.dtype == stored.dtype and reader.shape == shape
    assert reader.mode == ("memmap" if name in MEMMAPPED else "proxy" if "nifti" in name
                           else "chunks")
    assert np.array_equal(reader.read(), whole)
    for counts in GRIDS_2D if dims == 2 else GRIDS_3D:
        parts = []
        for block in rank_blocks(reader.size, counts):
            part = reader.read(block)
            assert np.array_equal(part, whole[(slice(None), *block)]), (counts, block)
            parts.append(part)
        assert np.array_equal(assemble(parts, counts), whole)


def test_ome_zarr_reads_level_0_of_two(tmp_path):
    a = rng_array((2, *SIZE_2D))
    write_ome_zarr(tmp_path / "x.ome.zarr", a, {"c": "channel", "y": "space", "x": "space"})
    assert zarr.open_group(tmp_path / "x.ome.zarr", mode="r")["s1"].shape == (2, 19, 12)
    assert np.array_equal(SampleReader(tmp_path / "x.ome.zarr").read(), a)


def test_nifti_scaled_values_and_5d(tmp_path):
    a = rng_array(SIZE_3D, np.int16)
    image = nib.Nifti1Image(a, np.eye(4))
    image.header.set_slope_inter(0.5, 10.0)
    nib.save(image, tmp_path / "s.nii")
    reader = SampleReader(tmp_path / "s.nii", 3)
    want = a * 0.5 + 10.0
    assert reader.dtype.kind == "f" and np.allclose(reader.read()[0], want)
    block = (slice(2, 5), slice(0, 11), slice(4, 9))
    assert np.allclose(reader.read(block)[0], want[block])
    b = rng_array((*SIZE_3D, 1, 2), np.int16)  # (X, Y, Z, T=1, C): T dropped
    write_nifti(tmp_path / "v.nii.gz", b)
    assert np.array_equal(SampleReader(tmp_path / "v.nii.gz").read(), np.moveaxis(b[..., 0, :],
                                                                                  -1, 0))


# ------------------------------------------------------------------------------- layouts
def test_layout_guesses_and_refuses():
    assert Layout.resolve((3, 40, 50), 2) == Layout(0, (1, 2))
    assert Layout.resolve((40, 50, 4), 2) == Layout(2, (0, 1))
    assert Layout.resolve((40, 50), 2) == Layout(None, (0, 1))
    assert Layout.resolve((40, 50, 60), 3) == Layout(None, (0, 1, 2))
    for shape in [(3, 40, 2), (40, 50, 60)]:  # both ends small, or neither: ask
        with pytest.raises(ValueError, match="layout='CHW' or 'HWC'"):
            Layout.resolve(shape, 2)
    assert Layout.resolve((40, 50, 60), 2, layout="HWC") == Layout(2, (0, 1))
    assert Layout.resolve((1, 3, 1, 8, 9), 2, axes="TCSSS") == Layout(1, (3, 4), (0, 2))
    with pytest.raises(ValueError, match="spatial dimensions"):
        Layout.resolve((2, 3, 5, 8, 9), 2, axes="TCSSS")  # 2 frames: not an axis to drop
    with pytest.raises(ValueError, match="one letter per axis"):
        Layout.resolve((40, 50), 2, layout="CHW")


def test_explicit_layout_of_an_ambiguous_file(tmp_path):
    a = rng_array((3, 40, 2))  # channels first or last?
    np.save(tmp_path / "x.npy", a)
    with pytest.raises(ValueError, match="pass layout="):
        SampleReader(tmp_path / "x.npy")
    assert np.array_equal(SampleReader(tmp_path / "x.npy", layout="HWC").read(), hwc(a))
    assert np.array_equal(SampleReader(tmp_path / "x.npy", layout="CHW").read(), a)


def test_bad_blocks_and_files(tmp_path):
    np.save(tmp_path / "x.npy", rng_array(SIZE_2D))
    reader = SampleReader(tmp_path / "x.npy")
    with pytest.raises(ValueError, match="not inside"):
        reader.read((slice(30, 40), slice(0, 5)))
    with pytest.raises(ValueError, match="not a block-readable file"):
        open_array(tmp_path / "x.png")
    zarr.open_group(tmp_path / "g.zarr", mode="w").create_array("a", shape=(4,), dtype="u1")
    with pytest.raises(ValueError, match="no OME-Zarr multiscales"):
        open_array(tmp_path / "g.zarr")


WRITERS = {"npy": (write_npy, "x.npy"), "zarr": (write_zarr, "x.zarr"),
           "tiff": (write_tiff, "x.tif"), "nifti": (write_nifti, "x.nii.gz")}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_dtypes_that_would_lose_data_are_refused_naming_the_file(fmt, tmp_path):
    """Complex (its imaginary part), booleans as an image, strings: one ValueError naming the
    file. Integers of any width and floats are read; booleans as masks."""
    write, name = WRITERS[fmt]
    shape = (12, 10, 4) if fmt == "nifti" else (12, 10)  # NIfTI: a volume
    refused = {"complex64": "imaginary"}
    if fmt != "nifti":  # NIfTI stores neither booleans nor strings
        refused["bool"] = "booleans only as masks"
    if fmt == "npy":
        refused["<U2"] = "store integers or floats"
    for dtype, message in refused.items():
        path = tmp_path / dtype.strip("<") / name
        path.parent.mkdir()
        write(path, np.ones(shape, dtype))
        with pytest.raises(ValueError, match=message) as e:
            SampleReader(path)
        assert str(e.value).startswith(str(path)), e.value
    ok = ["uint8", "int16", "uint32", "float32", "float64"] + (["float16"] if fmt != "nifti"
                                                                else [])  # fmt: skip
    for dtype in ok:
        path = tmp_path / dtype / name
        path.parent.mkdir()
        write(path, np.ones(shape, dtype))
        assert SampleReader(path).read().dtype == np.dtype(dtype)
    path = tmp_path / "mask" / name
    path.parent.mkdir()
    write(path, np.ones(shape, bool if fmt != "nifti" else np.uint8))
    assert SampleReader(path, mask=True).size == shape


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_files_no_library_can_read_are_named_with_the_librarys_message(fmt, tmp_path):
    write, name = WRITERS[fmt]
    path = tmp_path / name
    if fmt == "zarr":
        write(path, rng_array((12, 10)))
        (path / "zarr.json").write_text("{not json")
    else:
        path.write_bytes(b"not what the name says " * 4)
    with pytest.raises(ValueError, match=f"cannot read its header as {fmt}") as e:
        SampleReader(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("x.nii", write_nifti),
        ("x.nii.gz", write_nifti),
        ("x.tif", write_tiff),
        ("x.tif", lambda p, a: write_tiff(p, a, tile=(16, 16))),
        ("x.tif", lambda p, a: write_tiff(p, a, compression="zlib")),
    ],
    ids=["nii", "nii.gz", "tiff-striped", "tiff-tiled", "tiff-zlib"],
)
def test_a_file_cut_off_in_its_data_is_refused_with_its_header(name, write, tmp_path):
    """A NIfTI or TIFF file cut short after its header would pass the launcher's checks
    and fail on the ranks. Its header says where its data end: a ``.nii`` file's size, a
    ``.nii.gz`` stream's length, a TIFF's strip and tile offsets."""
    path = tmp_path / name
    rng = np.random.default_rng(0)
    write(path, rng.random((32, 32, 4) if "nii" in name else (48, 40)).astype(np.float32))
    SampleReader(path).read()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 7 // 10])
    with pytest.raises(ValueError, match="cannot read its header") as e:
        SampleReader(path)
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value), e.value


def test_a_nifti_stream_of_several_gzip_members_is_read(tmp_path):
    """The gzip trailer gives the length of the last member only: the stream is inflated to
    check it, not refused."""
    import gzip

    a = np.random.default_rng(0).random((12, 10, 6)).astype(np.float32)
    write_nifti(tmp_path / "x.nii", a)
    raw = (tmp_path / "x.nii").read_bytes()
    (tmp_path / "y.nii.gz").write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]))
    assert np.array_equal(SampleReader(tmp_path / "y.nii.gz").read()[0], a)


# ---------------------------------------------------- only the chunks a block touches are read
def chunk_reads(monkeypatch, store_cls):
    """The chunk keys that ``store_cls.get`` serves from now on (metadata keys left out)."""
    keys: list[str] = []
    get = store_cls.get

    async def counting(self, key, *args, **kw):
        if not key.rsplit("/", 1)[-1].startswith((".z", "zarr.json")):
            keys.append(key)
        return await get(self, key, *args, **kw)

    monkeypatch.setattr(store_cls, "get", counting)
    return keys


def touched(block, chunk):
    """Chunk grid indices that ``block`` overlaps, chunks of ``chunk`` along each axis."""
    ranges = [range(s.start // c, (s.stop - 1) // c + 1) for s, c in zip(block, chunk, strict=True)]
    return set(itertools.product(*ranges))


def key_index(key):
    """A chunk key's grid index: ``0.1`` (tifffile, zarr format 2) or ``c/0/1`` (format 3)."""
    last = key.split("/", 1)[-1] if key.startswith("c/") else key.rsplit("/", 1)[-1]
    return tuple(int(v) for v in last.replace("/", ".").split("."))


@pytest.mark.parametrize("layout", ["tiled", "striped"])
def test_tiff_reads_only_the_tiles_of_the_block(layout, tmp_path, monkeypatch):
    from tifffile.zarr import ZarrTiffStore

    size, chunk = (70, 60), ((16, 16) if layout == "tiled" else (8, 60))
    a = rng_array(size)
    kw = dict(tile=(16, 16)) if layout == "tiled" else dict(rowsperstrip=8)
    tifffile.imwrite(tmp_path / "x.tif", a, compression="zlib", **kw)
    reader = SampleReader(tmp_path / "x.tif")
    assert reader.mode == "chunks"
    keys = chunk_reads(monkeypatch, ZarrTiffStore)
    for counts in [(2, 2), (3, 1), (1, 4)]:
        for block in rank_blocks(size, counts):
            keys.clear()
            assert np.array_equal(reader.read(block)[0], a[block])
            assert {key_index(k) for k in keys} == touched(block, chunk), block
            assert len(keys) == len(touched(block, chunk))  # each tile decoded once
    keys.clear()
    reader.read()  # the negative control: a whole read touches every tile
    assert len(keys) == len(touched((slice(0, 70), slice(0, 60)), chunk)) > 4


def test_zarr_reads_only_the_chunks_of_the_block(tmp_path, monkeypatch):
    a = rng_array(SIZE_3D)
    write_zarr(tmp_path / "x.zarr", a, chunks=(3, 4, 4))
    reader = SampleReader(tmp_path / "x.zarr", 3)
    keys = chunk_reads(monkeypatch, zarr.storage.LocalStore)
    for block in rank_blocks(SIZE_3D, (2, 2, 1)):
        keys.clear()
        assert np.array_equal(reader.read(block)[0], a[block])
        assert {key_index(k) for k in keys} == touched(block, (3, 4, 4))
    keys.clear()
    reader.read()
    assert len(keys) == 3 * 3 * 3


def test_uncompressed_tiff_is_memory_mapped(tmp_path):
    a = rng_array(SIZE_2D)
    tifffile.imwrite(tmp_path / "x.tif", a)
    with open_array(tmp_path / "x.tif") as array:
        assert isinstance(array._array, np.memmap)
        assert np.array_equal(array.read((slice(3, 9), slice(0, 4))), a[3:9, :4])


# ------------------------------------------------------------------------- crops and flips
def test_view_source_mirrors_the_block():
    view = View(start=(10, 3), size=(20, 8), flips=(True, False))
    # Rows [0, 5) of a flipped crop of 20 rows at 10: the crop's last 5 rows, 25..29, reversed.
    assert view.source((slice(0, 5), slice(2, 6))) == (slice(25, 30), slice(5, 9))
    assert view.source((slice(15, 20), slice(0, 8))) == (slice(10, 15), slice(3, 11))


def test_view_reads_its_block_of_the_flipped_crop(tmp_path):
    a = rng_array((2, *SIZE_3D))
    np.save(tmp_path / "x.npy", a)
    reader = SampleReader(tmp_path / "x.npy", 3)
    for flips in itertools.product([False, True], repeat=3):
        view = View((1, 2, 0), (5, 8, 9), flips)
        crop = a[:, 1:6, 2:10, 0:9]
        want = np.flip(crop, tuple(1 + d for d, f in enumerate(flips) if f))
        for counts in [(2, 1, 1), (1, 2, 2), (1, 1, 3)]:
            parts = [view.read(reader, b) for b in rank_blocks(view.size, counts)]
            assert np.array_equal(assemble(parts, counts), want), (flips, counts)


def test_draw_view_same_for_a_seed_differs_by_epoch():
    def draw(epoch, index):
        return draw_view((37, 23), (16, 16), (0, 1), np.random.default_rng((0, epoch, index)))

    assert draw(0, 3) == draw(0, 3)
    views = {draw(e, 3) for e in range(8)}
    assert len({v.start for v in views}) > 1 and len({v.flips for v in views}) > 1
    assert all(0 <= v.start[0] <= 21 and 0 <= v.start[1] <= 7 for v in views)
    assert draw_view((37, 23), (16, 16), (0, 1), None) == View((10, 3), (16, 16), (False, False))
    with pytest.raises(ValueError, match="does not fit"):
        draw_view((37, 23), (40, 16), (), None)


# --------------------------------------------------------------------------- the data set
def write_set(root, split, n, size, channels, image_ext, mask_ext, seed=0):
    rng = np.random.default_rng(seed)
    images, masks = [], []
    for i in range(n):
        image = rng.integers(0, 255, (*size, channels) if channels else size).astype(np.uint8)
        mask = rng.integers(0, 4, size).astype(np.uint8)
        for kind, data, ext in (("images", image, image_ext), ("masks", mask, mask_ext)):
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"s{i}{ext}"
            {".npy": write_npy, ".zarr": write_zarr, ".tif": write_tiff,
             ".nii.gz": write_nifti}[ext](path, data)
        images.append(np.moveaxis(image, -1, 0) if channels else image[None])
        masks.append(mask)
    return images, masks


SETS = [  # (image ext, mask ext, sample size, channels, grids)
    (".tif", ".zarr", (37, 23), 3, [(2, 2), (1, 3), (4, 1)]),
    (".npy", ".tif", (29, 31), 0, [(3, 1), (2, 2)]),
    (".nii.gz", ".nii.gz", SIZE_3D, 2, [(2, 1, 1), (1, 2, 2), (2, 2, 1)]),
]


@pytest.mark.parametrize("spec", SETS, ids=[f"{s[0]}+{s[1]}" for s in SETS])
def test_every_rank_gets_its_block_of_the_same_crop_and_flip(spec, tmp_path):
    image_ext, mask_ext, size, channels, grids = spec
    images, masks = write_set(tmp_path, "train", 3, size, channels, image_ext, mask_ext)
    crop = tuple(n - 3 for n in size)
    kw = dict(crop=crop, flip=tuple(range(len(size))), normalize=None)
    whole = BlockDataset(tmp_path, "train", **kw)
    assert whole.augment and len(whole) == 3
    seen = set()
    for epoch in range(3):
        whole.set_epoch(epoch)
        for index in range(3):
            view = whole.view(index)
            seen.add((view.start, view.flips))
            x, y = whole[index]
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            assert x.shape == (max(channels, 1), *crop) and y.shape == crop
            crop_slices = tuple(slice(o, o + n) for o, n in zip(view.start, crop, strict=True))
            axes = tuple(d for d, f in enumerate(view.flips) if f)
            want_x = np.flip(images[index][(slice(None), *crop_slices)], [1 + d for d in axes])
            want_y = np.flip(masks[index][crop_slices], axes)
            assert np.array_equal(x.numpy(), want_x) and np.array_equal(y.numpy(), want_y)
            for counts in grids:
                coords = list(itertools.product(*[range(p) for p in counts]))
                ranks = [BlockDataset(tmp_path, "train", block=BlockLayout(counts, c), **kw)
                         for c in coords]
                for r in ranks:
                    r.set_epoch(epoch)
                xs, ys = zip(*[r[index] for r in ranks], strict=True)
                assert np.array_equal(assemble(xs, counts), x.numpy()), (epoch, index, counts)
                assert np.array_equal(assemble(ys, counts), y.numpy())
    assert len(seen) > 3  # crops and flips do change with the epoch and sample


def test_test_split_is_centred_and_unflipped(tmp_path):
    write_set(tmp_path, "train", 2, SIZE_2D, 3, ".npy", ".npy")
    images, masks = write_set(tmp_path, "test", 2, SIZE_2D, 3, ".npy", ".npy", seed=1)
    data = BlockDataset(tmp_path, "test", crop=(21, 11), flip=(0, 1), normalize=None)
    x, y = data[1]
    assert np.array_equal(x.numpy(), images[1][:, 8:29, 6:17])
    assert np.array_equal(y.numpy(), masks[1][8:29, 6:17])


def test_channel_stats_streaming_equals_a_whole_read(tmp_path):
    a, b = rng_array((3, 20, 7), seed=1), rng_array((3, 9, 5), seed=2) * 3
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    readers = [SampleReader(tmp_path / "a.npy"), SampleReader(tmp_path / "b.npy")]
    values = np.concatenate([a.reshape(3, -1), b.reshape(3, -1)], 1).astype(np.float64)
    for max_elements in [1, 30, 100, 10**6]:  # slabs of 1 row, a few rows, whole files
        mean, std = channel_stats(readers, max_elements)
        assert np.allclose(mean, values.mean(1), rtol=1e-12)
        assert np.allclose(std, values.std(1), rtol=1e-12)


def test_normalization_statistics_computed_once_and_cached(tmp_path, monkeypatch):
    images, _ = write_set(tmp_path, "train", 3, SIZE_2D, 3, ".tif", ".npy")
    write_set(tmp_path, "test", 1, SIZE_2D, 3, ".tif", ".npy", seed=1)
    values = np.concatenate([i.reshape(3, -1) for i in images], 1).astype(np.float64)
    data = BlockDataset(tmp_path, "train", block=BlockLayout((2, 2), (1, 0)))
    saved = json.loads((tmp_path / blockset.STATS_FILE).read_text())
    assert np.allclose(saved["mean"], values.mean(1)) and np.allclose(saved["std"], values.std(1))
    x, _ = data[0]
    raw = images[0][:, 19:37, 0:12].astype(np.float64)
    want = (raw - values.mean(1)[:, None, None]) / values.std(1)[:, None, None]
    assert np.allclose(x.numpy(), want, atol=1e-5)

    def fail(*args, **kw):
        raise AssertionError("statistics computed twice")

    monkeypatch.setattr(blockset, "file_stats", fail)
    blockset._STATS.clear()  # from the JSON file now
    test = BlockDataset(tmp_path, "test")  # the training images' statistics
    assert np.allclose(test.mean, values.mean(1)) and np.allclose(test.std, values.std(1))


def test_masks_must_fit_their_images(tmp_path):
    write_set(tmp_path, "train", 2, SIZE_2D, 3, ".npy", ".npy")
    np.save(tmp_path / "train" / "masks" / "s1.npy", np.zeros((37, 22), np.uint8))
    with pytest.raises(ValueError, match=r"mask .*s1.npy is 1 x \(37, 22\)"):
        BlockDataset(tmp_path, "train", normalize=None)
    (tmp_path / "train" / "masks" / "s1.npy").unlink()
    with pytest.raises(ValueError, match=r"no mask .* for s1\.npy"):
        BlockDataset(tmp_path, "train", normalize=None)


def test_mask_labels_checked(tmp_path):
    write_set(tmp_path, "train", 1, SIZE_2D, 0, ".npy", ".npy")
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        BlockDataset(tmp_path, "train", normalize=None, num_classes=3)[0]


def test_data_loader_workers_read_blocks(tmp_path):
    """Readers reopen their files in each worker (zarr's I/O loop and tifffile's handles are
    not shared across a fork); a BlockLayout pickles into spawned workers too."""
    write_set(tmp_path, "train", 4, SIZE_2D, 3, ".zarr", ".tif")
    layout = BlockLayout((2, 1), (1, 0))
    assert pickle.loads(pickle.dumps(layout)) == layout
    data = BlockDataset(tmp_path, "train", block=layout, crop=(30, 20),
                        flip=(1,), normalize=None)
    want = [data[i] for i in range(4)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    xs, ys = zip(*loader, strict=True)
    assert torch.equal(torch.cat(xs), torch.stack([x for x, _ in want]))
    assert torch.equal(torch.cat(ys), torch.stack([y for _, y in want]))
    assert pickle.loads(pickle.dumps(data))[2][1].equal(want[2][1])
