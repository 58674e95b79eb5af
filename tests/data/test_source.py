"""``data.name`` parsed once (:mod:`parallelkit.data.source`): each form of the grammar gives
its kind, directory, format and spatial dimensions, and the questions readers ask of it; a
name of no form is one ``ValueError`` naming the key. Pure: no files, no processes."""

from __future__ import annotations

import pytest

from parallelkit.data import DataConfig, check_config
from parallelkit.data.source import DATASETS, Source, parse_source


@pytest.mark.parametrize(
    ("name", "dims", "want"),
    [
        ("digits", 3, Source("digits", "set")),  # data.dims is for block folders and classes
        ("shapes3d", 2, Source("shapes3d", "set", dims=3)),
        ("webdataset", 2, Source("webdataset", "shards")),
        ("zarr:/data/slides", 2, Source("zarr:/data/slides", "blocks", 2, "zarr", "/data/slides")),
        ("npy:/v", 3, Source("npy:/v", "blocks", 3, "npy", "/v")),
        ("nifti:/ct", 2, Source("nifti:/ct", "blocks", 3, "nifti", "/ct")),  # always volumes
        ("mine.data:Cells", 2, Source("mine.data:Cells", "class")),
        ("mine.data:Cells", 3, Source("mine.data:Cells", "class", dims=3)),
    ],
)
def test_each_form_parses_to_its_source(name, dims, want):
    assert parse_source(name, dims) == want


def test_the_questions_readers_ask():
    blocks, shards = parse_source("tiff:/s"), parse_source("webdataset")
    users, shapes, digits = parse_source("m:C"), parse_source("segfolder3d"), parse_source("digits")
    assert blocks.is_block_folder and blocks.has_masks and not blocks.is_volume
    assert shards.is_shards and not shards.has_masks  # its manifest says, when read
    assert users.is_users_class and not users.has_masks  # its first item says
    assert shapes.has_masks and shapes.is_volume and shapes.kind == "set"
    assert not (digits.has_masks or digits.is_block_folder or digits.is_users_class)
    assert {parse_source(n).kind for n in DATASETS} == {"set", "shards"}


@pytest.mark.parametrize(
    ("name", "dims", "message"),
    [
        ("mnist", 2, r"data.name='mnist' is not one of digits, .* or your own package.module"),
        ("pkg/mod:Class", 2, r"data.name='pkg/mod:Class' is not one of"),
        ("mine.data:", 2, r"data.name='mine.data:' is not one of"),
        ("zarr:", 2, r"data.name='zarr:' needs a directory after the colon"),
        ("npy:/v", 4, r"data.dims \(now 4\) 2 for images or 3 for volumes"),
    ],
)
def test_a_name_of_no_form_is_one_error_naming_the_key(name, dims, message):
    with pytest.raises(ValueError, match=message):
        parse_source(name, dims)
    with pytest.raises(ValueError, match=message):  # and so at the config's check
        check_config(DataConfig(name=name, dims=dims, channels=1), "train")


def test_the_config_and_its_check_give_the_one_parsed_source():
    cfg = DataConfig(name="npy:/v", dims=3, channels=1)
    assert cfg.source is check_config(cfg, "train") is parse_source("npy:/v", 3)
    cfg.dims = 2  # a config changed after its check reads the new value, not a stale one
    assert cfg.source.dims == 2
