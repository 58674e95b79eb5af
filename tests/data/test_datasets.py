"""parallelkit.data: datasets, per-rank loaders and WebDataset shards, in one process.

Data ranks are simulated by building the loader of every rank (rank=r, size=n) in this
process: the loaders must agree without communicating, which is exactly what is tested
(equal batch counts in training, disjoint batches, every test sample exactly once).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from parallelkit.data import (
    DataConfig,
    ShardError,
    SyntheticDataset,
    build_loader,
    load_dataset,
    normalize,
    shard_main,
    write_shards,
)
from parallelkit.data.datasets import DigitsDataset, _digits, fit
from parallelkit.data.shardio import MANIFEST, encode_sample
from parallelkit.data.shardstream import resume, round_robin, segments


# ----------------------------------------------------------------------------- helpers
class Indexed(torch.utils.data.Dataset):
    """``n`` 8-bit 4x4 gray images whose label is their index: identity survives the loader."""

    def __init__(self, n: int) -> None:
        self.num_classes = n
        g = torch.Generator().manual_seed(n)
        self.pixels = torch.randint(0, 256, (n, 1, 4, 4), generator=g, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.pixels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return normalize(self.pixels[i].float() / 255.0), i


def write_uneven(root: Path, counts: list[int], split: str = "train") -> int:
    """Shards of the given (uneven) sizes holding Indexed samples, and their manifest."""
    import webdataset as wds

    data, pos, shards = Indexed(sum(counts)), 0, []
    root.mkdir(parents=True, exist_ok=True)
    for i, count in enumerate(counts):
        name = f"{split}-{i:06d}.tar"
        with wds.TarWriter(str(root / name), encoder=False) as w:
            for j in range(pos, pos + count):
                w.write(encode_sample(*data[j], "png", f"{j:09d}"))
        shards.append({"file": name, "samples": count})
        pos += count
    entry = {
        "shards": shards,
        "samples": pos,
        "image_size": 4,
        "channels": 1,
        "num_classes": pos,
        "encoding": "png",
    }
    splits = {split: entry}
    (root / MANIFEST).write_text(json.dumps({"format": "parallelkit-shards", "splits": splits}))
    return pos


def shards_cfg(root: Path, workers: int = 0, **kw) -> DataConfig:
    return DataConfig(
        name="webdataset", root=str(root), image_size=4, channels=1, workers=workers, **kw
    )


def run_epoch(loader, epoch: int = 0, start_batch: int = 0) -> list[tuple[torch.Tensor, ...]]:
    loader.set_epoch(epoch, start_batch)
    return [(x, y) for x, y in loader]


def ids(batches) -> list[int]:
    """Sample identities: labels for Indexed shards."""
    return [i for _, y in batches for i in y.tolist()]


def fingerprints(batches) -> list[tuple[float, ...]]:
    """Sample identities for synthetic images (Gaussian pixels never repeat)."""
    return [tuple(row[:3].tolist()) for x, _ in batches for row in x.flatten(1)]


def synthetic(n: int, workers: int = 0) -> DataConfig:
    return DataConfig(
        name="synthetic", train_samples=n, test_samples=n, image_size=4, channels=1, workers=workers
    )


# ----------------------------------------------------------------------------- datasets
def test_digits_shapes_labels_determinism():
    train, test = load_dataset(DataConfig(), "train"), load_dataset(DataConfig(), "test")
    assert (len(train), len(test)) == (1438, 359)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    assert x.min() >= -1.0 - 1e-6 and x.max() <= 1.0 + 1e-6 and x.min() < -0.9
    assert {train[i][1] for i in range(200)} == set(range(10))
    again = DigitsDataset("train")
    assert torch.equal(again[7][0], train[7][0]) and again[7][1] == train[7][1]
    gray = load_dataset(DataConfig(channels=1, image_size=16), "train")
    assert gray[7][0].shape == (1, 16, 16)
    one = load_dataset(DataConfig(channels=1), "train")[7][0]
    assert torch.equal(one.expand(3, -1, -1), train[7][0])  # gray repeated to RGB


def test_digits_read_without_scikit_learn_equal_load_digits(monkeypatch, tmp_path):
    """The shipped CSV, read directly, gives ``load_digits()`` exactly; where the file is not
    where it is looked for, ``load_digits`` itself is the fallback."""
    from sklearn.datasets import load_digits

    data = load_digits()
    want = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images, labels = _digits.__wrapped__()
    assert torch.equal(images, want) and torch.equal(labels, torch.tensor(data.target))
    moved = importlib.machinery.ModuleSpec("sklearn", None, origin=str(tmp_path / "init.py"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: moved)
    fallback = _digits.__wrapped__()
    assert torch.equal(fallback[0], want) and torch.equal(fallback[1], labels)


def test_digits_train_test_disjoint():
    train, test = DigitsDataset("train"), DigitsDataset("test")
    a, b = set(train.indices.tolist()), set(test.indices.tolist())
    assert not a & b and len(a | b) == 1797


def test_synthetic_deterministic_and_lazy():
    ds = load_dataset(synthetic(50), "train")
    x, y = ds[3]
    assert torch.equal(x, load_dataset(synthetic(50), "train")[3][0]) and y == ds[3][1]
    assert not torch.equal(x, ds[4][0])
    assert not torch.equal(x, load_dataset(synthetic(50), "test")[3][0])  # splits differ
    start = time.perf_counter()
    big = SyntheticDataset(10**9, image_size=1024, channels=3)
    assert time.perf_counter() - start < 0.1
    assert not any(isinstance(v, torch.Tensor) for v in vars(big).values())
    assert big[123_456_789][0].shape == (3, 1024, 1024)
    with pytest.raises(IndexError):
        big[10**9]


def test_synthetic_labels_are_learnable():
    ds = SyntheticDataset(400, image_size=16, channels=1, num_classes=4)
    means = torch.zeros(4)
    for i in range(len(ds)):
        x, y = ds[i]
        means[y] += x.mean() / 100
    assert torch.all(means[1:] > means[:-1])  # class means increase with the label


def write_png(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def test_imagefolder(tmp_path):
    white = np.full((10, 12, 3), 255, np.uint8)
    write_png(tmp_path / "train" / "cat" / "a.png", white)
    write_png(tmp_path / "train" / "cat" / "b.jpg", np.zeros((20, 20, 3), np.uint8))
    write_png(tmp_path / "train" / "dog" / "c.png", np.zeros((8, 8), np.uint8))  # gray
    write_png(tmp_path / "val" / "dog" / "d.png", white)
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
    cfg = DataConfig(name="imagefolder", root=str(tmp_path), image_size=8)
    train, test = load_dataset(cfg, "train"), load_dataset(cfg, "test")  # test reads val/
    assert (len(train), len(test)) == (3, 1) and train.classes == ["cat", "dog"]
    assert [train[i][1] for i in range(3)] == [0, 0, 1] and test[0][1] == 1
    x, _ = train[0]
    assert x.shape == (3, 8, 8) and torch.allclose(x, torch.ones_like(x))
    assert torch.equal(train[2][0], -torch.ones(3, 8, 8))
    gray = load_dataset(DataConfig(name="imagefolder", root=str(tmp_path), channels=1), "test")
    assert gray[0][0].shape == (1, 32, 32)


def test_imagefolder_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="nowhere"):
        load_dataset(DataConfig(name="imagefolder", root=str(missing)), "train")
    write_png(tmp_path / "train" / "cat" / "a.png", np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"test.* or .*val"):
        load_dataset(DataConfig(name="imagefolder", root=str(tmp_path)), "test")
    bad = tmp_path / "train" / "cat" / "broken.png"
    bad.write_bytes(b"\x89PNG but not really")
    cfg = DataConfig(name="imagefolder", root=str(tmp_path))
    ds = load_dataset(cfg, "train")
    with pytest.raises(ValueError, match=r"broken\.png"):
        ds[1]
    loader = build_loader(cfg, "train", rank=0, size=1, batch_size=1)
    with pytest.raises(ValueError, match=r"broken\.png"):
        run_epoch(loader)
    with pytest.raises(ValueError, match=r"data\.root"):
        load_dataset(DataConfig(name="imagefolder"), "train")


def fake_cifar(root: Path, per_batch: int = 4) -> dict[str, np.ndarray]:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, per_batch).tolist()
        with open(root / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
        written[name] = data
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, f)
    return written


def test_cifar10_round_trip(tmp_path):
    written = fake_cifar(tmp_path / "cifar-10-batches-py")
    cfg = DataConfig(name="cifar10", root=str(tmp_path / "cifar-10-batches-py"))
    train, test = load_dataset(cfg, "train"), load_dataset(cfg, "test")
    assert (len(train), len(test)) == (20, 4) and train.num_classes == 10
    expected = torch.from_numpy(written["data_batch_2"][1].reshape(3, 32, 32)).float() / 255
    assert torch.equal(train[5][0], normalize(expected))
    small = load_dataset(
        DataConfig(name="cifar10", root=cfg.root, image_size=16, channels=1), "test"
    )
    assert small[0][0].shape == (1, 16, 16)


def test_cifar10_missing_file(tmp_path):
    fake_cifar(tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").unlink()
    with pytest.raises(ValueError, match="data_batch_3"):
        load_dataset(DataConfig(name="cifar10", root=str(tmp_path / "c")), "train")
    assert len(load_dataset(DataConfig(name="cifar10", root=str(tmp_path / "c")), "test")) == 4
    (tmp_path / "c" / "test_batch").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="test_batch"):
        load_dataset(DataConfig(name="cifar10", root=str(tmp_path / "c")), "test")


def test_config_checks_and_omegaconf():
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), {"name": "synthetic"})
    assert len(build_loader(cfg, "train", rank=0, size=1, batch_size=8)) == 1024 // 8
    for bad, match in [
        ({"name": "mnist"}, "data.name"),
        ({"channels": 2}, "channels"),
        ({"image_size": 0}, "image_size"),
        ({"name": "cifar10"}, "data.root"),
    ]:
        with pytest.raises(ValueError, match=match):
            build_loader(DataConfig(**bad), "train", rank=0, size=1, batch_size=8)
    with pytest.raises(ValueError, match="rank"):
        build_loader(DataConfig(), "train", rank=2, size=2, batch_size=8)
    with pytest.raises(ValueError, match="too few"):
        build_loader(synthetic(10), "train", rank=0, size=4, batch_size=3)
    with pytest.raises(ValueError, match="split"):
        build_loader(DataConfig(), "validation", rank=0, size=1, batch_size=8)


# ----------------------------------------------------------------------------- map-style
@pytest.mark.parametrize("n", [37, 64, 101])
def test_map_train_equal_batches_and_disjoint(n):
    for size in (1, 2, 3, 4):
        loaders = [
            build_loader(synthetic(n), "train", rank=r, size=size, batch_size=4)
            for r in range(size)
        ]
        epochs = [run_epoch(loader, epoch=1) for loader in loaders]
        expected = n // size // 4
        assert expected > 0
        assert [len(loader) for loader in loaders] == [expected] * size
        assert [len(e) for e in epochs] == [expected] * size
        assert all(x.shape == (4, 1, 4, 4) and y.dtype == torch.int64 for e in epochs for x, y in e)
        seen = [f for e in epochs for f in fingerprints(e)]
        assert len(seen) == size * expected * 4 and len(set(seen)) == len(seen)


def test_map_epoch_order_and_resume():
    def make(seed=0, workers=0):
        return build_loader(
            synthetic(50, workers), "train", rank=1, size=2, batch_size=4, seed=seed
        )

    loader = make()
    e0, e1 = fingerprints(run_epoch(loader, 0)), fingerprints(run_epoch(loader, 1))
    assert e0 != e1
    assert fingerprints(run_epoch(make(), 1)) == e1  # a function of (seed, epoch)
    assert fingerprints(run_epoch(make(seed=5), 1)) != e1
    full = run_epoch(loader, 3)
    for workers in (0, 2):
        resumed = run_epoch(make(workers=workers), 3, start_batch=2)
        assert len(resumed) == len(full) - 2
        assert fingerprints(resumed) == fingerprints(full[2:])
    assert run_epoch(loader, 3, start_batch=len(loader)) == []
    with pytest.raises(ValueError, match="start_batch"):
        loader.set_epoch(0, len(loader) + 1)


@pytest.mark.parametrize("n", [1, 10, 37])
def test_map_test_split_covers_each_sample_once(n):
    dataset = load_dataset(synthetic(n), "test")
    reference = fingerprints([(torch.stack([dataset[i][0] for i in range(n)]), None)])
    for size in (1, 2, 3, 4):
        loaders = [
            build_loader(synthetic(n), "test", rank=r, size=size, batch_size=4) for r in range(size)
        ]
        seen = [f for loader in loaders for f in fingerprints(run_epoch(loader))]
        assert sorted(seen) == sorted(reference)  # each sample once, no padding duplicates
        assert max(map(len, loaders)) - min(map(len, loaders)) <= 1


# ----------------------------------------------------------------------------- webdataset
def test_webdataset_round_trip_digits(tmp_path):
    digits = load_dataset(DataConfig(), "test")
    for encoding, tolerance in [("png", 1.0 / 255 + 1e-6), ("npy", 0.0)]:
        out = tmp_path / encoding
        files = write_shards(digits, str(out), 100, "test", encoding=encoding, shuffle_seed=None)
        assert [Path(f).name for f in files] == [f"test-{i:06d}.tar" for i in range(4)]
        cfg = DataConfig(name="webdataset", root=str(out))
        loader = build_loader(cfg, "test", rank=0, size=1, batch_size=64)
        batches = run_epoch(loader)
        images, labels = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        assert loader.num_samples == len(digits) == len(labels) and loader.num_classes == 10
        assert torch.equal(labels, digits.labels)
        expected = torch.stack([digits[i][0] for i in range(len(digits))])
        assert (images - expected).abs().max() <= tolerance


def test_webdataset_png_is_exact_for_8bit(tmp_path):
    data = Indexed(30)
    write_shards(data, str(tmp_path), 7, "train", shuffle_seed=None)
    manifest = json.loads((tmp_path / MANIFEST).read_text())["splits"]["train"]
    assert [s["samples"] for s in manifest["shards"]] == [7, 7, 7, 7, 2]
    cfg = shards_cfg(tmp_path, shuffle=False)
    batches = run_epoch(build_loader(cfg, "train", rank=0, size=1, batch_size=30))
    assert ids(batches) == list(range(30))
    assert torch.equal(batches[0][0], torch.stack([data[i][0] for i in range(30)]))


UNEVEN = [1, 17, 5, 30, 2, 8, 40]  # 103 samples in 7 shards


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_equal_batches_from_uneven_shards(tmp_path, workers):
    total = write_uneven(tmp_path, UNEVEN)
    for size in (1, 2, 3, 4):
        loaders = [
            build_loader(shards_cfg(tmp_path, workers), "train", rank=r, size=size, batch_size=4)
            for r in range(size)
        ]
        epochs = [run_epoch(loader, epoch=2) for loader in loaders]
        expected = total // (size * 4)
        assert [len(loader) for loader in loaders] == [expected] * size
        assert [len(e) for e in epochs] == [expected] * size
        assert all(x.shape == (4, 1, 4, 4) for e in epochs for x, _ in e)
        seen = [i for e in epochs for i in ids(e)]  # no sample read by two ranks
        assert len(seen) == size * expected * 4 and len(set(seen)) == len(seen)


def test_uneven_shards_control():
    """Negative control: the naive split (rank r takes shards r, r+size, ...) is unequal here."""
    for size in (2, 3, 4):
        per_rank = [sum(UNEVEN[r::size]) for r in range(size)]
        assert len(set(per_rank)) > 1, per_rank
    overlap = ids([(None, torch.tensor([1, 2]))]) + ids([(None, torch.tensor([2]))])
    assert len(set(overlap)) < len(overlap)  # the disjointness check does catch a repeat


def test_webdataset_few_shards_split_samples(tmp_path):
    total = write_uneven(tmp_path, [50])  # one shard, 4 ranks x 2 workers
    loaders = [
        build_loader(shards_cfg(tmp_path, 2), "train", rank=r, size=4, batch_size=3)
        for r in range(4)
    ]
    seen = [ids(run_epoch(loader)) for loader in loaders]
    assert [len(s) for s in seen] == [total // 12 * 3] * 4
    assert len(set().union(*map(set, seen))) == sum(map(len, seen))


def test_webdataset_shards_split_across_ranks(tmp_path):
    write_uneven(tmp_path, [16] * 8)
    opened = []
    for r in range(4):
        loader = build_loader(shards_cfg(tmp_path), "train", rank=r, size=4, batch_size=4)
        loader.set_epoch(1)
        opened.append({shard for shard, _, _ in loader.dataloader.dataset.worker_segments(0, 1)})
    assert [len(s) for s in opened] == [2] * 4  # each rank reads a quarter of the shards
    assert set().union(*opened) == set(range(8))


def test_webdataset_epoch_order_and_resume(tmp_path):
    write_uneven(tmp_path, UNEVEN)

    def make(workers=0, seed=0):
        return build_loader(
            shards_cfg(tmp_path, workers),
            "train",
            rank=1,
            size=2,
            batch_size=4,
            seed=seed,
            shuffle_buffer=16,
        )

    for workers in (0, 2):
        e0, e1 = ids(run_epoch(make(workers), 0)), ids(run_epoch(make(workers), 1))
        assert e0 != e1 and ids(run_epoch(make(workers), 1)) == e1
        assert ids(run_epoch(make(workers, seed=3), 1)) != e1
        assert e1 != sorted(e1)  # samples shuffled, not only shards
        full = run_epoch(make(workers), 4)
        assert len(full) == 12
        for start in (1, 5, 11, 12):
            resumed = run_epoch(make(workers), 4, start_batch=start)
            assert ids(resumed) == ids(full[start:]), (workers, start)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, full[start:], strict=True))


def test_resume_rotation_matches_round_robin():
    for batches in range(0, 12):
        for workers in (1, 2, 3, 5):
            counts = [len(c) for c in np.array_split(np.arange(batches), workers)]
            assert len(round_robin(counts)) == batches
            for start in range(batches + 1):
                resume(counts, start)  # asserts that the restarted order is the tail


def test_segments():
    assert segments([3, 5, 2], [2, 0, 1], 1, 6) == [(2, 1, 2), (0, 0, 3), (1, 0, 1)]
    assert segments([3, 5, 2], [0, 1, 2], 4, 4) == []


@pytest.mark.parametrize("total", [13, 103])
def test_webdataset_test_split_covers_each_sample_once(tmp_path, total):
    write_uneven(tmp_path, [total // 3, total - total // 3], split="test")
    for size in (1, 2, 3, 4):
        for workers in (0, 2) if size == 3 else (0,):
            loaders = [
                build_loader(shards_cfg(tmp_path, workers), "test", rank=r, size=size, batch_size=4)
                for r in range(size)
            ]
            epochs = [run_epoch(loader) for loader in loaders]
            assert [len(e) for e in epochs] == [len(loader) for loader in loaders]
            assert sorted(i for e in epochs for i in ids(e)) == list(range(total))


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_shard_is_named(tmp_path, workers):
    write_uneven(tmp_path, [10, 10, 10])
    shard = tmp_path / "train-000001.tar"
    bad = re.escape(str(shard))  # the message names the file by its full path
    good = shard.read_bytes()

    def loader():
        return build_loader(shards_cfg(tmp_path, workers), "train", rank=0, size=1, batch_size=2)

    shard.write_bytes(os.urandom(len(good)))  # garbage: caught before training starts
    with pytest.raises(ShardError, match=bad):
        loader()
    shard.write_bytes(good[: len(good) // 2 + 100])  # truncated mid-block
    with pytest.raises(ShardError, match=bad + ".*truncated"):
        loader()
    shard.write_bytes(good[: 512 * 12])  # truncated on a block boundary: caught when read
    with pytest.raises(ShardError, match=bad):
        run_epoch(loader())
    broken = bytearray(good)
    at = good.index(b"IHDR")
    broken[at : at + 40] = b"\0" * 40  # a damaged PNG inside an intact tar
    shard.write_bytes(bytes(broken))
    with pytest.raises(ShardError, match=bad + ".*sample"):
        run_epoch(loader())
    shard.unlink()
    with pytest.raises(ShardError, match=bad):
        loader()
    shard.write_bytes(good)
    assert len(run_epoch(loader())) == 15  # the control: the intact shard reads


def test_webdataset_missing_manifest(tmp_path):
    with pytest.raises(ValueError, match=r"manifest\.json"):
        build_loader(shards_cfg(tmp_path), "train", rank=0, size=1, batch_size=2)
    write_uneven(tmp_path, [5], split="train")
    with pytest.raises(ValueError, match="'test' split"):
        build_loader(shards_cfg(tmp_path), "test", rank=0, size=1, batch_size=2)
    with tarfile.open(tmp_path / "train-000000.tar") as tar:
        assert sorted(tar.getnames())[:2] == ["000000000.cls", "000000000.png"]


def test_shard_main_end_to_end(tmp_path, capsys):
    out = tmp_path / "shards"
    argv = [str(out), "--samples-per-shard", "500", "--image-size", "16", "--channels", "1"]
    assert shard_main(["digits", *argv]) == 0
    assert "train: 1438 samples" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "test-000000.tar",
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
    ]
    cfg = DataConfig(name="webdataset", root=str(out), image_size=16, channels=1)
    loader = build_loader(cfg, "train", rank=0, size=2, batch_size=32)
    x, y = next(iter(loader))
    assert len(loader) == 1438 // 64 and x.shape == (32, 1, 16, 16) and y.max() < 10
    syn = [
        "synthetic",
        str(tmp_path / "syn"),
        "--samples-per-shard",
        "8",
        "--train-samples",
        "20",
        "--test-samples",
        "4",
        "--image-size",
        "8",
    ]
    assert shard_main(syn) == 0  # synthetic defaults to exact npy
    assert "npy" in capsys.readouterr().out
    cfg = DataConfig(name="webdataset", root=str(tmp_path / "syn"), image_size=8)
    reread = build_loader(cfg, "train", rank=0, size=1, batch_size=20, drop_last=False)
    original = load_dataset(DataConfig(name="synthetic", train_samples=20, image_size=8), "train")
    samples = [original[i] for i in range(20)]
    by_print = {fingerprints([(x[None], None)])[0]: (x, y) for x, y in samples}
    ((x_read, y_read),) = run_epoch(reread)
    assert len(x_read) == 20
    for x, y in zip(x_read, y_read.tolist(), strict=True):
        x0, y0 = by_print[fingerprints([(x[None], None)])[0]]
        assert torch.equal(x, x0) and y == y0  # npy round trip: the exact float32 pixels
    assert shard_main(["nonsense", str(out), "--samples-per-shard", "5"]) == 1
    assert "nonsense" in capsys.readouterr().err


def test_shard_module_runs_standalone(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "parallelkit.data.shard", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cifar10:DIR" in proc.stdout and "--samples-per-shard" in proc.stdout


def test_fit_converts_channels():
    rgb = torch.rand(3, 5, 5)
    assert torch.equal(fit(rgb, 5, 3), rgb)
    gray = fit(rgb, 5, 1)
    assert torch.allclose(gray[0], 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2])
    assert fit(gray, 10, 3).shape == (3, 10, 10)
