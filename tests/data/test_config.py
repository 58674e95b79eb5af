"""The data keys of block sources (``data.name=FORMAT:DIR``), as a config: ``data.image_size``
as one size or per-dimension sizes (:func:`parallelkit.data.config.crop_shape`), any channel
count, ``data.normalize`` and its ``window``/``percentiles``, ``data.flips``, ``data.level`` and
``data.foreground``. Pure: no files, no processes. Each mistake is one ``ValueError`` naming the
key; every default keeps what the config did before the key existed."""

from __future__ import annotations

import pytest

from parallelkit.data import DataConfig, check_config
from parallelkit.data.config import crop_shape
from parallelkit.data.loader import block_layout, normalizer
from parallelkit.train.config import load


def blocks(**kw) -> DataConfig:
    return DataConfig(**{"name": "npy:/data", "channels": 1, **kw})


def test_an_integer_is_a_square_or_a_cube_as_before():
    assert crop_shape(DataConfig(image_size=32)) == (32, 32)
    assert crop_shape(blocks(image_size=16, dims=3)) == (16, 16, 16)
    assert crop_shape(DataConfig(name="shapes3d", image_size=8)) == (8, 8, 8)


def test_a_list_gives_each_dimension_of_block_sources():
    assert crop_shape(blocks(image_size=[48, 40])) == (48, 40)
    assert crop_shape(blocks(image_size=[16, 48, 40], dims=3)) == (16, 48, 40)
    assert crop_shape(blocks(name="nifti:/ct", image_size=(80, 512, 512))) == (80, 512, 512)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"image_size": [16, 48, 40]}, r"a list of 2 positive integers, \[H, W\]"),
        ({"image_size": [16, 48], "dims": 3}, r"a list of 3 positive integers, \[D, H, W\]"),
        ({"image_size": [16, 0]}, r"data.image_size=\[16, 0\] must be"),
        ({"image_size": [16, -4]}, r"data.image_size=\[16, -4\] must be"),
        ({"image_size": 0}, r"data.image_size=0 must be"),
        ({"image_size": "big"}, r"data.image_size='big' must be"),
        ({"image_size": [16.5, 8]}, r"data.image_size=\[16.5, 8\] must be"),
    ],
)
def test_a_wrong_image_size_is_one_error_naming_the_key(kw, message):
    with pytest.raises(ValueError, match=message):
        check_config(blocks(**kw), "train")


def test_other_sources_refuse_a_list_in_one_line():
    with pytest.raises(ValueError, match=r"data.image_size=\[16, 16\]: a list of sizes is for "):
        check_config(DataConfig(name="digits", image_size=[16, 16]), "train")


def test_the_loaders_layout_splits_each_dimension_by_its_own_size():
    # rows of 10 into 2 (5, 5), columns of 7 into 2 (4, 3): rank (1, 1)
    image = block_layout(blocks(), (1, 2, 2), (0, 1, 1))
    assert image.slices(10, 7) == (slice(5, 10), slice(4, 7))
    volume = block_layout(blocks(dims=3), (2, 1, 1), (1, 0, 0))
    assert volume.slices(4, 10, 7) == (slice(2, 4), slice(0, 10), slice(0, 7))
    with pytest.raises(ValueError, match=r"parallel.depth=2 splits the D of volumes"):
        block_layout(blocks(), (2, 1, 1), (0, 0, 0))


def test_channels_any_count_for_blocks_one_or_three_elsewhere():
    check_config(blocks(channels=4), "train")
    check_config(blocks(channels=31), "train")
    with pytest.raises(
        ValueError, match=r"data.channels=4 must be 1 .* or 3 .* for data.name=digits"
    ):
        check_config(DataConfig(channels=4), "train")
    with pytest.raises(ValueError, match=r"data.channels=0 must be a positive integer"):
        check_config(blocks(channels=0), "train")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"normalize": "minmax"}, "data.normalize='minmax' must be one of zscore, window, "),
        ({"normalize": "window"}, r"data.normalize=window needs data.window=\[low, high\]"),
        ({"normalize": "window", "window": [400, -1000]}, r"not data.window=\[400, -1000\]"),
        ({"normalize": "window", "window": [1, 2, 3]}, r"not data.window=\[1, 2, 3\]"),
        ({"window": [-1000, 400]}, "is used by data.normalize=window alone"),
        ({"percentiles": [99.5, 0.5]}, r"data.percentiles=\[99.5, 0.5\] must be \[low, high\]"),
        ({"percentiles": [0, 101]}, r"data.percentiles=\[0, 101\] must be"),
        ({"flips": [2]}, r"data.flips=\[2\] must list distinct spatial axes of the 2-D"),
        ({"flips": [0, 0]}, r"data.flips=\[0, 0\] must list distinct"),
        ({"flips": [3], "dims": 3}, r"each in 0..2 \(D, H, W\)"),
        ({"rotate": [1]}, r"data.rotate=\[1\] must name the plane of the quarter turns, two"),
        ({"rotate": [1, 1], "dims": 3}, r"two distinct spatial axes in 0..2 \(D, H, W\)"),
        ({"rotate": [0, 2]}, r"data.rotate=\[0, 2\] must name .* in 0..1 \(H, W\), or be \[\]"),
        ({"level": -1}, "data.level=-1 must be a pyramid level"),
        ({"foreground": 1.5}, r"data.foreground=1.5 must be a fraction of the crops, in \[0, 1\]"),
    ],
)
def test_block_keys_are_checked_in_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        check_config(blocks(**kw), "train")


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"normalize": "window", "window": [0, 1]}, "data.normalize='window'"),
        ({"flips": [0]}, r"data.flips=\[0\]"),
        ({"rotate": [0, 1]}, r"data.rotate=\[0, 1\]"),
        ({"level": 1}, "data.level=1"),
        ({"foreground": 0.3}, "data.foreground=0.3"),
    ],
)
def test_other_sources_keep_the_defaults(kw, shown):
    with pytest.raises(ValueError, match=f"{shown} is for data.name=FORMAT:DIR sources"):
        check_config(DataConfig(name="shapes", num_classes=3, **kw), "train")


def test_the_defaults_keep_todays_behaviour():
    cfg = DataConfig()
    assert (cfg.normalize, cfg.window, cfg.percentiles) == ("zscore", [], [0.5, 99.5])
    assert (cfg.flips, cfg.level, cfg.foreground) == ([], 0, 0.0)
    check_config(cfg, "train")
    check_config(blocks(), "train")
    made = normalizer(blocks())
    assert made is not None and made.mode == "zscore" and made.mean is None  # dataset stats
    assert normalizer(blocks(normalize="none")) is None


def test_the_training_config_takes_the_keys_from_the_command_line():
    cfg = load(overrides=[
        "train.task=segment", "data.name=nifti:/ct", "data.channels=4",
        "data.image_size=[16,48,40]", "data.normalize=window", "data.window=[-1000,400]",
        "data.flips=[1,2]", "data.level=1", "data.foreground=0.33",
    ]).data  # fmt: skip
    assert crop_shape(cfg) == (16, 48, 40) and list(cfg.image_size) == [16, 48, 40]
    assert (cfg.channels, cfg.normalize, list(cfg.window)) == (4, "window", [-1000.0, 400.0])
    assert (list(cfg.flips), cfg.level, cfg.foreground) == ([1, 2], 1, 0.33)
    assert load(overrides=["data.image_size=24"]).data.image_size == 24
    with pytest.raises(ValueError, match=r"data.image_size=.*a list of sizes is for"):
        load(overrides=["data.image_size=[16,48,40]"])  # digits: one integer
    with pytest.raises(ValueError, match=r"data.image_size=\[16, 48, 40\] must be .* 2 posit"):
        load(overrides=["train.task=segment", "data.name=npy:/x", "data.image_size=[16,48,40]"])


def test_the_grid_check_compares_each_dimension_with_its_own_size():
    from parallelkit.train.loop.preflight import check_grid

    def cfg(size):
        return load(overrides=[
            "train.task=segment", "data.name=npy:/x", "data.dims=3", "train.batch_size=2",
            f"data.image_size={size}", "parallel.strategy=spatial", "parallel.depth=2",
        ])  # fmt: skip

    assert check_grid(cfg("[2,48,40]"), 2)["depth"] == 2
    with pytest.raises(ValueError, match=r"data.image_size=\[1, 48, 40\] \(depth: 1\) has fewer "
                                         r"planes than the parallel.depth=2 blocks"):  # fmt: skip
        check_grid(cfg("[1,48,40]"), 2)
