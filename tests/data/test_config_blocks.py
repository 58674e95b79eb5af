"""The data keys of block sources on files: crops of per-dimension sizes, any channel count,
``data.normalize`` (zscore, window, percentile, none), ``data.flips``, ``data.rotate``,
``data.level`` and ``data.foreground``, through ``build_loader`` as ``parallelkit train``
builds them.

Two checks for each: one rank's sample against the same crop cut and normalized by hand in
numpy, and the blocks of every rank of a spatial grid (simulated in one process, as in
tests/data/test_readers.py), put together, against that one rank's whole crop: every rank cuts the
same crop, flips it alike and normalizes it with the same numbers.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from data.test_readers import assemble
from parallelkit.data import DataConfig, build_loader
from parallelkit.data import intensity as intensity_module
from parallelkit.data.blockset import BlockDataset, draw_view
from parallelkit.data.config import crop_shape
from parallelkit.data.intensity import Normalizer, sample_values
from parallelkit.data.readers import format_of, stem_of
from parallelkit.geometry import BlockLayout

zarr = pytest.importorskip("zarr")
tifffile = pytest.importorskip("tifffile")


def write_set(root, split, images, masks, ext=".npy", write=np.save):
    for i, (image, mask) in enumerate(zip(images, masks, strict=True)):
        for kind, data in (("images", image), ("masks", mask)):
            (root / split / kind).mkdir(parents=True, exist_ok=True)
            write(root / split / kind / f"s{i}{ext}", data)


def random_set(root, shape, channels, n=(3, 2), seed=0, dtype=np.int16):
    """``n`` training and test samples ``(C, *shape)`` of values in [-1200, 1200) (CT-like)
    and masks of 0..2; returns them per split."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, count in zip(("train", "test"), n, strict=True):
        images = [rng.integers(-1200, 1200, (channels, *shape)).astype(dtype) for _ in range(count)]
        masks = [rng.integers(0, 3, shape).astype(np.uint8) for _ in range(count)]
        write_set(root, split, images, masks)
        out[split] = images, masks
    return out


def config(root, image_size, dims=2, channels=1, **kw) -> DataConfig:
    return DataConfig(name=f"npy:{root}", image_size=image_size, dims=dims, channels=channels,
                      num_classes=3, **kw)  # fmt: skip


def dataset(cfg, split, grid=None, coords=None) -> BlockDataset:
    """The loader's data set, for the rank at ``coords`` of a spatial ``grid`` (None: 1 rank)."""
    block = None if grid is None else BlockLayout(grid, coords)
    loader = build_loader(cfg, split, rank=0, size=1, batch_size=1, seed=0, block=block)
    return loader.dataloader.dataset


def assert_blocks_tile(cfg, split, grid, whole: BlockDataset, epochs=(0, 1, 2)):
    """Every rank's block of every sample, put together, is the 1-rank whole crop."""
    ranks = [dataset(cfg, split, grid, c) for c in itertools.product(*[range(p) for p in grid])]
    for epoch in epochs:
        whole.set_epoch(epoch)
        for r in ranks:
            r.set_epoch(epoch)
        for i in range(len(whole)):
            x, y = whole[i]
            xs, ys = zip(*[r[i] for r in ranks], strict=True)
            assert np.array_equal(assemble(xs, grid), x.numpy()), (epoch, i, grid)
            assert np.array_equal(assemble(ys, grid), y.numpy())


def cut(a, view):
    """``view``'s crop of ``a`` (C, *spatial) (or a mask), flipped, by hand."""
    lead = a.ndim - len(view.start)
    crop = a[(slice(None),) * lead + tuple(slice(o, o + n) for o, n in
                                           zip(view.start, view.size, strict=True))]  # fmt: skip
    axes = tuple(lead + d for d, f in enumerate(view.flips) if f)
    return np.flip(crop, axes) if axes else crop


# ------------------------------------------------------------------ 1. per-dimension crops
def test_a_crop_of_each_dimensions_size_tiles_over_the_ranks(tmp_path):
    data = random_set(tmp_path, (9, 14, 12), channels=2)
    cfg = config(tmp_path, [5, 11, 7], dims=3, channels=2)
    loader = build_loader(cfg, "train", rank=0, size=1, batch_size=1)
    assert loader.shape == (5, 11, 7) and "2x5x11x7" in repr(loader)
    train = np.concatenate([a.reshape(2, -1) for a in data["train"][0]], 1).astype(np.float64)
    mean, std = train.mean(1)[:, None, None, None], train.std(1)[:, None, None, None]
    test = dataset(cfg, "test")
    x, y = test[1]  # centred: (9-5)//2, (14-11)//2, (12-7)//2
    image, mask = data["test"][0][1], data["test"][1][1]
    assert x.shape == (2, 5, 11, 7) and y.shape == (5, 11, 7)
    assert np.allclose(x.numpy(), (image[:, 2:7, 1:12, 2:9] - mean) / std, atol=1e-5)
    assert np.array_equal(y.numpy(), mask[2:7, 1:12, 2:9])
    whole = dataset(cfg, "train")
    starts = set()
    for epoch in range(4):
        whole.set_epoch(epoch)
        view = whole.view(0)
        starts.add(view.start)
        want = (cut(data["train"][0][0], view) - mean) / std
        assert np.allclose(whole[0][0].numpy(), want, atol=1e-5)
    assert len(starts) > 1  # training crops move
    for grid in [(2, 1, 1), (1, 2, 2), (1, 1, 3)]:
        assert_blocks_tile(cfg, "train", grid, whole)
    assert_blocks_tile(cfg, "test", (2, 2, 1), test, epochs=(0,))


def test_a_crop_larger_than_a_sample_along_one_dimension_names_it(tmp_path):
    random_set(tmp_path, (20, 12), channels=1)
    with pytest.raises(ValueError, match=r"crop \(8, 16\) does not fit in .*s0.npy, of size"):
        dataset(config(tmp_path, [8, 16]), "train")


# ------------------------------------------------------------------------------ 2. channels
def test_any_channel_count_and_every_sample_must_have_it(tmp_path):
    random_set(tmp_path, (10, 12), channels=4)  # 4-channel MRI (T1, T1c, T2, FLAIR)
    x, _ = dataset(config(tmp_path, [6, 8], channels=4), "train")[0]
    assert x.shape == (4, 6, 8)
    np.save(tmp_path / "test" / "images" / "s1.npy", np.zeros((3, 10, 12), np.int16))
    with pytest.raises(ValueError, match=r"data.channels=4, but .*test/images/s1.npy has 3 ch"):
        dataset(config(tmp_path, [6, 8], channels=4), "test")


def test_preflight_finds_a_sample_of_other_channels_from_its_header(tmp_path):
    from parallelkit.train.config import load
    from parallelkit.train.loop.preflight import check_data

    random_set(tmp_path, (10, 12), channels=4)
    cfg = load(
        overrides=[
            "train.task=segment",
            f"data.name=npy:{tmp_path}",
            "data.channels=4",
            "data.num_classes=3",
            "data.image_size=[6,8]",
            "train.batch_size=2",
        ]
    )
    check_data(cfg, None)
    np.save(tmp_path / "train" / "images" / "s2.npy", np.zeros((3, 10, 12), np.int16))
    with pytest.raises(ValueError, match=r"^data.channels=4, but \S*s2.npy has 3 channels$"):
        check_data(cfg, None)


def test_a_channel_axis_the_shape_cannot_place_is_placed_by_the_count(tmp_path):
    """Multiplexed microscopy: 12 channels first in an npy of (12, 10, 14); neither end is
    small, and data.channels=12 says which end holds the channels."""
    random_set(tmp_path, (10, 14), channels=12)
    x, _ = dataset(config(tmp_path, [6, 8], channels=12, normalize="none"), "test")[0]
    assert x.shape == (12, 6, 8)
    with pytest.raises(ValueError, match=r"cannot tell whether shape \(12, 10, 14\) keeps"):
        dataset(config(tmp_path, [6, 8], channels=5), "test")


# -------------------------------------------------------------------------- 3. normalize
def test_window_clips_then_scales_to_0_1(tmp_path):
    data = random_set(tmp_path, (11, 13), channels=2)
    cfg = config(tmp_path, [7, 9], channels=2, normalize="window", window=[-1000, 400],
                 flips=[0, 1])  # fmt: skip
    whole = dataset(cfg, "train")
    assert whole.mean is None and whole.normalizer.mode == "window"
    for epoch in range(3):
        whole.set_epoch(epoch)
        for i in range(3):
            raw = cut(data["train"][0][i], whole.view(i)).astype(np.float64)
            want = (np.clip(raw, -1000, 400) + 1000) / 1400
            got = whole[i][0].numpy()
            assert np.allclose(got, want, atol=1e-6) and got.min() == 0 and got.max() == 1
    assert_blocks_tile(cfg, "train", (2, 2), whole)
    assert_blocks_tile(cfg, "train", (1, 3), whole)


def percentile_by_hand(a, low=0.5, high=99.5):
    """Per channel: clip to the sample's percentiles, then z-score with the clipped values'
    mean and std (numpy, float64)."""
    v = a.reshape(a.shape[0], -1).astype(np.float64)
    lo, hi = np.percentile(v, [low, high], axis=1)
    c = np.clip(v, lo[:, None], hi[:, None])
    shape = (-1,) + (1,) * (a.ndim - 1)
    return lo.reshape(shape), hi.reshape(shape), c.mean(1).reshape(shape), c.std(1).reshape(shape)


def test_percentile_uses_each_whole_samples_statistics(tmp_path):
    data = random_set(tmp_path, (6, 9, 10), channels=2)
    cfg = config(tmp_path, [4, 5, 6], dims=3, channels=2, normalize="percentile",
                 percentiles=[2.0, 98.0], flips=[0, 2])  # fmt: skip
    whole = dataset(cfg, "train")
    for epoch in range(2):
        whole.set_epoch(epoch)
        for i in range(3):
            image = data["train"][0][i]
            lo, hi, mean, std = percentile_by_hand(image, 2, 98)
            want = (np.clip(cut(image, whole.view(i)), lo, hi) - mean) / std
            assert np.allclose(whole[i][0].numpy(), want, atol=1e-5)
    # a rank's block is normalized by the whole sample's numbers, not its block's
    assert_blocks_tile(cfg, "train", (2, 1, 1), whole)
    assert_blocks_tile(cfg, "train", (1, 2, 3), whole, epochs=(0,))
    saved = json.loads((tmp_path / intensity_module.SAMPLE_STATS_FILE).read_text())
    assert len(saved) == 3  # the training samples' statistics, kept for the next run


def test_percentile_of_a_large_sample_is_taken_on_a_grid_of_every_s_th_voxel(tmp_path):
    data = random_set(tmp_path, (23, 17), channels=1)
    reader = BlockDataset(tmp_path, "train", normalize=None).images[0]
    image = data["train"][0][0]
    assert np.array_equal(sample_values(reader, 10**6), image.reshape(1, -1))  # all: exact
    # 23 x 17 = 391 values, at most 50: stride 3 leaves 8 x 6 = 48
    assert np.array_equal(sample_values(reader, 50), image[:, ::3, ::3].reshape(1, -1))
    small = Normalizer("percentile", max_values=50)
    grid = [BlockDataset(tmp_path, "train", crop=(20, 15), normalize=small,
                         block=BlockLayout((2, 1), (r, 0))) for r in range(2)]  # fmt: skip
    one = BlockDataset(tmp_path, "train", crop=(20, 15), normalize=small)
    lo, hi, mean, std = percentile_by_hand(image[:, ::3, ::3])
    view = one.view(0)
    want = (np.clip(cut(image, view), lo, hi) - mean) / std
    assert np.allclose(one[0][0].numpy(), want, atol=1e-5)
    assert np.array_equal(assemble([g[0][0] for g in grid], (2, 1)), one[0][0].numpy())


def test_percentile_statistics_are_computed_once_per_file(tmp_path, monkeypatch):
    random_set(tmp_path, (8, 8), channels=1)
    cfg = config(tmp_path, 6, normalize="percentile")
    first = dataset(cfg, "train")

    def fail(*args, **kw):
        raise AssertionError("computed twice")

    monkeypatch.setattr(intensity_module, "sample_values", fail)
    again = dataset(cfg, "train")  # memory
    intensity_module.per_sample.__globals__["_MEMORY"].clear()
    from_file = dataset(cfg, "train")  # sample_stats.json
    for d in (again, from_file):
        assert all(np.array_equal(a.shift, b.shift) and np.array_equal(a.high, b.high)
                   for a, b in zip(first.intensity, d.intensity, strict=True))  # fmt: skip


def test_none_gives_the_stored_values(tmp_path):
    data = random_set(tmp_path, (8, 9), channels=1)
    data_set = dataset(config(tmp_path, 8, normalize="none"), "test")
    assert data_set.normalizer is None and data_set.mean is None
    assert np.array_equal(data_set[0][0].numpy(), data["test"][0][0][:, :, 0:8].astype(np.float32))


# ------------------------------------------------------------------------------ 4. flips
def test_flips_only_along_the_axes_named(tmp_path):
    data = random_set(tmp_path, (9, 10, 11), channels=1)
    default = dataset(config(tmp_path, 6, dims=3, normalize="none"), "train")
    cfg = config(tmp_path, 6, dims=3, normalize="none", flips=[1, 2])
    flipped = dataset(cfg, "train")
    seen = set()
    for epoch in range(6):
        for d in (default, flipped):
            d.set_epoch(epoch)
        for i in range(3):
            assert default.view(i).flips == (False, False, False)  # today: no flips
            view = flipped.view(i)
            assert view.start == default.view(i).start  # the same crops as without flips
            seen.add(view.flips)
            want = cut(data["train"][0][i], view)
            assert np.array_equal(flipped[i][0].numpy(), want)
            assert np.array_equal(flipped[i][1].numpy(), cut(data["train"][1][i], view))
    assert {f[0] for f in seen} == {False} and len(seen) == 4
    assert_blocks_tile(cfg, "train", (1, 2, 2), flipped, epochs=range(3))
    assert dataset(cfg, "test").view(0).flips == (False, False, False)  # test: never


def where_in(sample, got, plane, flip_axes):
    """Every (turns, flipped axes, corner) at which ``got`` (C, *crop) is a window of
    ``np.flip(np.rot90(sample, turns, plane), flipped)``, ``sample`` (C, *size): how ``got``
    was cut, found by brute force from numpy's own rotation, not from the data set's views."""
    crop, found = got.shape[1:], []
    spatial = tuple(range(1, sample.ndim))
    for turns in range(4):
        for n in range(len(flip_axes) + 1):
            for flipped in itertools.combinations(flip_axes, n):
                t = np.rot90(sample, turns, tuple(1 + a for a in plane))
                t = np.flip(t, tuple(1 + a for a in flipped)) if flipped else t
                if any(c > n for c, n in zip(crop, t.shape[1:], strict=True)):
                    continue
                # (C, *corners, *crop) against got as (C, 1, ..., 1, *crop)
                windows = np.lib.stride_tricks.sliding_window_view(t, crop, spatial)
                same = windows == got.reshape(got.shape[:1] + (1,) * len(crop) + crop)
                corners = np.argwhere(same.all(axis=(0, *range(1 + len(crop), same.ndim))))
                found += [(turns, flipped, tuple(c)) for c in corners]
    return found


def test_quarter_turns_in_the_plane_named_with_flips(tmp_path):
    """A crop not square in the plane ([4, 6, 5] turned in [1, 2] reads 4 x 5 x 6 of the
    sample): each item is one window of one of the 8 flips and turns of the sample (found
    by numpy), its mask the same window; all 8 are drawn; every rank's blocks tile it."""
    data = random_set(tmp_path, (9, 10, 11), channels=1)
    cfg = config(tmp_path, 6, dims=3, normalize="none", crop=[4, 6, 5], flips=[0],
                 rotate=[1, 2])  # fmt: skip
    turned = dataset(cfg, "train")
    seen = set()
    for epoch in range(16):
        turned.set_epoch(epoch)
        for i in range(3):
            x, y = turned[i]
            assert x.shape == (1, 4, 6, 5) and y.shape == (4, 6, 5)
            (how,) = where_in(data["train"][0][i], x.numpy(), (1, 2), (0,))
            assert where_in(data["train"][1][i][None], y.numpy()[None], (1, 2), (0,)) == [how]
            seen.add(how[:2])
    assert len(seen) == 8  # 4 turns x flipped or not along D
    for grid in [(1, 2, 2), (2, 1, 3), (1, 3, 1)]:
        assert_blocks_tile(cfg, "train", grid, turned, epochs=range(4))
    test = dataset(cfg, "test")  # never turned outside training: the centred crop
    assert np.array_equal(test[0][0].numpy(), data["test"][0][0][:, 2:6, 2:8, 3:8])


def test_quarter_turns_need_the_turned_crop_to_fit_and_a_plane(tmp_path):
    random_set(tmp_path, (9, 10, 11), channels=1)
    with pytest.raises(ValueError, match=r"crop \(4, 11, 5\) or turned, \(4, 5, 11\), does not "
                       r"fit in .*s0.npy, of size \(9, 10, 11\)"):  # fmt: skip
        dataset(config(tmp_path, 6, dims=3, crop=[4, 11, 5], rotate=[1, 2]), "train")
    for bad in ([1], [1, 1], [0, 3], "12"):
        with pytest.raises(ValueError, match=r"data.rotate=.* must name the plane of the qu"):
            dataset(config(tmp_path, 6, dims=3, rotate=bad), "train")


# ---------------------------------------------------------------------- 5. pyramid levels
def write_ome_zarr(path, a):
    """A 2-level OME-Zarr image ``(C, H, W)`` (or a mask ``(H, W)``): level 1 every 2nd pixel."""
    g = zarr.open_group(path, mode="w")
    axes = ([{"name": "c", "type": "channel"}] if a.ndim == 3 else []) + [
        {"name": "y", "type": "space"}, {"name": "x", "type": "space"}]  # fmt: skip
    for name, level in (("s0", a), ("s1", a[..., ::2, ::2])):
        g.create_array(name, shape=level.shape, dtype=level.dtype, chunks=(4,) * a.ndim)[...] = (
            level
        )
    g.attrs["ome"] = {"version": "0.5", "multiscales": [
        {"axes": axes, "datasets": [{"path": "s0"}, {"path": "s1"}]}]}  # fmt: skip


def write_tiff_pyramid(path, a):
    """A 2-level pyramidal TIFF ``(H, W)``: level 1 (every 2nd pixel) in a SubIFD, tiled."""
    with tifffile.TiffWriter(path) as tif:
        tif.write(a, subifds=1, tile=(16, 16), compression="zlib")
        tif.write(a[::2, ::2], subfiletype=1, tile=(16, 16), compression="zlib")


@pytest.mark.parametrize(
    ("image_ext", "mask_ext"),
    [(".ome.zarr", ".ome.zarr"), (".tif", ".tif"), (".svs", ".ome.zarr"), (".svs", ".tif")],
)
def test_level_1_of_images_and_masks(tmp_path, image_ext, mask_ext):
    rng = np.random.default_rng(3)
    kind = "zarr" if image_ext == ".ome.zarr" else "tiff"
    for split, n in (("train", 2), ("test", 1)):
        for i in range(n):
            image = rng.integers(0, 4000, (1 if kind == "tiff" else 2, 40, 36)).astype(np.uint16)
            mask = rng.integers(0, 3, (40, 36)).astype(np.uint8)
            for folder, data, ext in (("images", image, image_ext), ("masks", mask, mask_ext)):
                (tmp_path / split / folder).mkdir(parents=True, exist_ok=True)
                path = tmp_path / split / folder / f"s{i}{ext}"
                if ext == ".ome.zarr":
                    write_ome_zarr(path, data)
                else:
                    write_tiff_pyramid(path, data[0] if data.ndim == 3 else data)
    channels = 2 if kind == "zarr" else 1
    cfg = DataConfig(name=f"{kind}:{tmp_path}", image_size=[14, 12], channels=channels,
                     num_classes=3, normalize="none", level=1, flips=[0, 1])  # fmt: skip
    whole = dataset(cfg, "train")
    assert whole.images[0].size == (20, 18) and whole.masks[0].size == (20, 18)
    s0 = tmp_path / "train" / "images" / f"s0{image_ext}"
    if kind == "zarr":
        full = np.asarray(zarr.open_group(s0, mode="r")["s0"])
    else:
        full = tifffile.imread(s0, level=0)[None]
    view = whole.view(0)
    assert np.array_equal(whole[0][0].numpy(), cut(full[:, ::2, ::2], view).astype(np.float32))
    assert_blocks_tile(cfg, "train", (2, 2), whole)
    with pytest.raises(ValueError, match=r"has pyramid levels 0..1.*not level 2 \(data.level\)"):
        dataset(DataConfig(**{**cfg.__dict__, "level": 2}), "train")


def test_whole_slide_extensions_are_tiff():
    """.svs and .ndpi by extension (tifffile reads both; it takes .ndpi's 64-bit offsets from
    the name, so a plain TIFF renamed .ndpi cannot stand in for one here)."""
    assert [format_of(f"a/slide{e}") for e in (".svs", ".SVS", ".ndpi")] == ["tiff"] * 3
    assert stem_of("a/slide.ndpi") == "slide" and stem_of("b/slide.svs") == "slide"


def test_a_mask_without_the_level_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        (tmp_path / split / "images").mkdir(parents=True)
        (tmp_path / split / "masks").mkdir(parents=True)
        write_ome_zarr(tmp_path / split / "images" / "s0.ome.zarr",
                       rng.integers(0, 9, (1, 16, 16)).astype(np.uint8))  # fmt: skip
        np.save(tmp_path / split / "masks" / "s0.npy", np.zeros((16, 16), np.uint8))
    cfg = DataConfig(name=f"zarr:{tmp_path}", image_size=8, channels=1, num_classes=3, level=1)
    with pytest.raises(ValueError, match=r"^\S*masks/s0.npy: an npy array has one level, 0, not "
                                         r"level 1 \(data.level\)$"):  # fmt: skip
        dataset(cfg, "train")
    dataset(DataConfig(**{**cfg.__dict__, "level": 0}), "train")  # level 0: fine


# ------------------------------------------------------------- 6. foreground oversampling
def sparse_set(root, n=4):
    """Samples (1, 30, 28) whose masks label one small square each, somewhere else."""
    rng = np.random.default_rng(5)
    out = {}
    for split in ("train", "test"):
        images = [rng.integers(0, 100, (1, 30, 28)).astype(np.uint8) for _ in range(n)]
        masks = []
        for i in range(n):
            m = np.zeros((30, 28), np.uint8)
            m[3 + 5 * i : 6 + 5 * i, 20 - 4 * i : 22 - 4 * i] = 1 + i % 2
            m[0, 0] = 255  # ignored: never a centre
            masks.append(m)
        write_set(root, split, images, masks)
        out[split] = images, masks
    return out


def test_foreground_crops_centre_on_a_labelled_voxel(tmp_path):
    data = sparse_set(tmp_path)
    base = config(tmp_path, [8, 6], normalize="none", flips=[0])
    cfg = DataConfig(**{**base.__dict__, "foreground": 1.0})
    always, never = dataset(cfg, "train"), dataset(base, "train")
    saved = json.loads((tmp_path / "foreground.json").read_text())
    assert sorted(len(v) for v in saved.values()) == [6] * 4  # 3 x 2 labelled pixels each
    for epoch in range(5):
        always.set_epoch(epoch)
        never.set_epoch(epoch)
        for i in range(4):
            view = always.view(i)
            mask = cut(data["train"][1][i], view)
            assert ((mask != 0) & (mask != 255)).any()
            moved = not (0 < view.start[0] < 30 - 8 and 0 < view.start[1] < 28 - 6)
            centre = tuple(o + n // 2 for o, n in zip(view.start, view.size, strict=True))
            assert moved or data["train"][1][i][centre] in (1, 2)  # centred where it could be
            assert np.array_equal(always[i][1].numpy(), mask)
    assert_blocks_tile(cfg, "train", (2, 2), always)
    # foreground=0 draws the crops drawn before the key existed: the generator's first draws
    drawn = [draw_view((30, 28), (8, 6), (0,), np.random.default_rng((0, 4, i))) for i in range(4)]
    assert [never.view(i) for i in range(4)] == drawn


def test_foreground_share_of_crops(tmp_path):
    sparse_set(tmp_path)
    cfg = config(tmp_path, [8, 6], normalize="none", foreground=0.33)
    data = dataset(cfg, "train")
    labelled = 0
    for epoch in range(60):
        data.set_epoch(epoch)
        for i in range(4):
            y = data[i][1].numpy()
            labelled += bool(((y != 0) & (y != 255)).any())
    # at least the 33% centred crops hold a label; random 8 x 6 crops of 30 x 28 rarely do
    assert 0.33 * 240 - 25 < labelled < 0.33 * 240 + 60
    assert dataset(cfg, "test").positions == [[]] * 4  # evaluation: centred crops, no draws


# ---------------------------------------------------------------------- 7. data.layout
def test_layout_names_axes_a_shape_cannot(tmp_path):
    """(Z, C, Y, X) volumes of 5 channels and 5 planes: the shape cannot tell the channels;
    ``data.layout=ZCYX`` does, and the blocks tile the crop read that way."""
    rng = np.random.default_rng(7)
    for split, n in (("train", 2), ("test", 1)):
        images = [rng.normal(size=(5, 5, 12, 10)).astype(np.float32) for _ in range(n)]
        write_set(tmp_path, split, images, [rng.integers(0, 3, (5, 12, 10)).astype("u1")] * n)
    cfg = config(tmp_path, [4, 8, 6], dims=3, channels=5, normalize="none", layout="ZCYX")
    data = dataset(cfg, "train")
    assert data.images[0].channels == 5 and data.images[0].size == (5, 12, 10)
    raw = np.load(tmp_path / "train" / "images" / "s0.npy").transpose(1, 0, 2, 3)  # C Z Y X
    assert np.array_equal(data[0][0].numpy(), cut(raw, data.view(0)))
    assert_blocks_tile(cfg, "train", (2, 1, 2), data, epochs=(0,))
    with pytest.raises(ValueError, match=r"data\.layout='ZCYX' is for"):
        build_loader(DataConfig(layout="ZCYX"), "train", rank=0, size=1, batch_size=1)


# ---------------------------------------------------------------------- 8. data.crop, crops
def test_crop_per_axis_and_several_crops_per_sample(tmp_path):
    """``data.crop=[D, H, W]`` is ``data.image_size``'s list form under its own name, and wins
    over it; ``data.crops_per_sample=3`` gives 3 different training crops of every sample per
    epoch (test samples: one, centred), each tiled exactly by the ranks' blocks."""
    random_set(tmp_path, (10, 14, 12), 1)
    cfg = config(tmp_path, 99, dims=3, crop=[4, 8, 6], crops_per_sample=3, normalize="none")
    assert crop_shape(cfg) == (4, 8, 6) == crop_shape(config(tmp_path, [4, 8, 6], dims=3))
    train = dataset(cfg, "train")
    assert len(train) == 3 * 3 and len(dataset(cfg, "test")) == 2
    starts = [train.view(i).start for i in range(3)]  # sample 0's three crops
    assert len(set(starts)) == 3, starts
    raw = np.load(tmp_path / "train" / "images" / "s1.npy")
    assert np.array_equal(train[4][0].numpy(), cut(raw, train.view(4)).astype(np.float32))
    assert_blocks_tile(cfg, "train", (2, 2, 1), train, epochs=(0, 1))
    with pytest.raises(ValueError, match=r"data\.crop=\[4, 8\] must list 3 positive sizes"):
        dataset(config(tmp_path, 8, dims=3, crop=[4, 8]), "train")
    with pytest.raises(ValueError, match=r"data\.crops_per_sample=0 must be 1 or more"):
        dataset(config(tmp_path, 8, dims=3, crops_per_sample=0), "train")
