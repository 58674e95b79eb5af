"""Data for training: datasets, per-rank loaders, and WebDataset tar shards.

    from parallelkit.data import DataConfig, build_loader
    loader = build_loader(DataConfig(name="digits"), "train", rank=grid.data_comm.rank,
                          size=grid.data_comm.size, batch_size=32, seed=0)

Modules, one idea each:

    source       data.name parsed once: a Source (a built-in set, shards, a block folder,
                 the user's class), whose questions every reader asks
    config       DataConfig (part of the OmegaConf training config) and its checks
    pixels       reading image files; size, channels and range of every image
    datasets     map-style datasets: digits, synthetic, image folders, CIFAR-10 batches
    shapes       generated segmentation data: textured shapes and their masks
    segfolder    a folder of images and PNG masks
    shapes3d     generated volume segmentation data: spheres and boxes in noise, with masks
    segfolder3d  a folder of .npy volumes and masks
    arrays       one stored array per block format (zarr, TIFF, NIfTI, npy): header, blocks
    axes         which stored axes are channels, spatial or dropped (data.layout)
    readers      block readers: a sample's block as (C, *spatial), read alone
    blockset     BlockDataset: each spatial rank's block of images and masks on disk
    intensity    data.normalize: z-score, intensity window, per-sample percentiles, none
    foreground   data.foreground: training crops centred on labelled voxels
    samplecache  per-file numbers computed once from the whole file (statistics, positions)
    sampler      RankSampler: torch's DistributedSampler + exact evaluation cover + resume
    shardio      tar shards on disk: write_shards, manifest.json, reading and decoding samples
    shardstream  which shard pieces each data rank and DataLoader worker streams
    loader       build_loader and Loader, the one entry point the trainer uses
    shard        the ``parallelkit data shard`` command (``python -m parallelkit.data.shard``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from parallelkit.data.config import DataConfig, check_config
from parallelkit.data.datasets import (
    Cifar10Dataset,
    DigitsDataset,
    ImageFolderDataset,
    SyntheticDataset,
    load_dataset,
)
from parallelkit.data.errors import DataError
from parallelkit.data.loader import Loader, build_loader
from parallelkit.data.pixels import denormalize, normalize
from parallelkit.data.sampler import RankSampler
from parallelkit.data.shardio import ShardError, check_shards, load_split, write_shards
from parallelkit.data.source import DATASETS, Source, parse_source

if TYPE_CHECKING:
    from parallelkit.data.shard import shard_main

__all__ = [
    "DATASETS",
    "Cifar10Dataset",
    "DataConfig",
    "DataError",
    "DigitsDataset",
    "ImageFolderDataset",
    "Loader",
    "RankSampler",
    "ShardError",
    "Source",
    "SyntheticDataset",
    "build_loader",
    "check_config",
    "check_shards",
    "denormalize",
    "load_dataset",
    "load_split",
    "normalize",
    "parse_source",
    "shard_main",
    "write_shards",
]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that `python -m parallelkit.data.shard` does not find the
    # module already imported by its package (runpy warns about that).
    if name == "shard_main":
        from parallelkit.data.shard import shard_main

        return shard_main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
