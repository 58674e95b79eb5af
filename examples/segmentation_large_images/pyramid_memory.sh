# The memory of predict.levels: a tiny run, then a 3072^2 image predicted on 2 ranks with 1 and 5 levels (predict_budget.md).
# Run from the repository root: bash examples/segmentation_large_images/pyramid_memory.sh
set -e
PY=${PY:-$(pwd)/.venv/bin/python}
mkdir -p /tmp/pk46mem && cd /tmp/pk46mem
export OMP_NUM_THREADS=1
$PY - <<'PY'
import zarr
from parallelkit.data.shapes import ShapesDataset
from pathlib import Path
root = Path("/tmp/pk46mem/data")
def slide(path, a):
    g = zarr.open_group(str(path), mode="w", zarr_format=3)
    g.create_array("0", shape=a.shape, dtype=a.dtype, chunks=(a.shape[0], 256, 256) if a.ndim == 3 else (256, 256))[...] = a
    axes = ([{"name": "c", "type": "channel"}] if a.ndim == 3 else []) + [{"name": n, "type": "space", "unit": "micrometer"} for n in "yx"]
    g.attrs["ome"] = {"version": "0.5", "multiscales": [{"axes": axes, "datasets": [{"path": "0", "coordinateTransformations": [{"type": "scale", "scale": [1.0] * (a.ndim - 2) + [0.5, 0.5]}]}]}]}
for split, count, size in (("train", 4, 64), ("test", 1, 3072)):
    for f in ("images", "masks"):
        (root / split / f).mkdir(parents=True, exist_ok=True)
    ds = ShapesDataset(count, image_size=size, channels=3, num_classes=3, base=0 if split == "train" else 900)
    for i in range(count):
        x, m = ds[i]
        slide(root / split / "images" / f"s{i}.ome.zarr", x.numpy())
        slide(root / split / "masks" / f"s{i}.ome.zarr", m.numpy().astype("u1"))
PY
$PY -m parallelkit.cli train train.run_dir=/tmp/pk46mem/run train.task=segment data.num_classes=3 data.channels=3 data.image_size=32 train.batch_size=4 train.max_steps=2 train.progress=false train.tensorboard=false train.plot=false model.width=8 parallel.ranks=1 data.name=zarr:/tmp/pk46mem/data > train.log 2>&1
for rep in 1 2; do
for lv in 1 5; do
  rm -rf out$lv
  /usr/bin/time -v $PY -m parallelkit.cli predict train.run_dir=/tmp/pk46mem/run predict.output=/tmp/pk46mem/out$lv predict.levels=$lv predict.probabilities=true parallel.rows=2 parallel.ranks=2 > p$lv.log 2>&1
  echo "levels=$lv rep=$rep: $(grep -o '"peak memory per rank, MiB (max)": [0-9]*' out$lv/predict.json) wall $(grep -o '"wall time (s)": [0-9.]*' out$lv/predict.json)"
done
done
