"""Fault and bad-input probes, run as a new user would: ``parallelkit train`` and
``parallelkit plan`` in a subprocess per probe (2 ranks, gloo, a few steps, a timeout each), on
tiny data sets built in a temporary directory. Not collected by pytest; run it by hand:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/scripts/fault_probes.py --out /tmp/fp.md
    python tests/scripts/fault_probes.py --only 3 6    # the probes of items 3 and 6
    python tests/scripts/fault_probes.py --family predict_outputs startup

The families (``--only`` keys; ``--family`` takes the method names): 1 overwrite, 2 dtypes,
3 checkpoints, 4 unreadable files and plan, 5 masks and late configs, 6 unreadable files,
7 plan and wording, ``predict`` (predict_outputs: the output folder of ``parallelkit predict``,
in tests/scripts/fault_probes_predict.py) and ``startup`` (the start-up of ``parallelkit
train``: threads, a stuck rank, a killed launcher, leftover torchrun variables, srun without
PMI; the same module).

For each probe it records the exit status, the seconds, whether a traceback appears, whether
the error line names the file at fault, whether the error came before any rank started (the
launcher's start line ``local ranks started by`` absent, no rank's leaving line, and
``train.run_dir`` not made), and a verdict against what docs/training.md promises: no traceback,
nothing deleted outside run_dir, no checkpoint deleted, no dtype dropped silently, every data
error found from the headers before the ranks start (exit status 2, one line naming the file).
Errors only a sample's values show (labels, corrupt chunks) are read by the ranks, before the
first step: those probes ask for exit status 2 and one line naming the file, and say so.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the jobs helpers

from jobs import is_rank

sys.modules.setdefault("fault_probes", sys.modules[__name__])  # for fault_probes_predict
from fault_probes_predict import PredictProbes  # noqa: E402

PYTHON = sys.executable
STARTED = re.compile(r"local ranks started by|uncaught exception on rank|rank \d+ of \d+ leaves")
TINY = [  # a ResNet-18 of width 4 on 16x16 digits, as tests/jobs.py
    "model.width=4", "model.stem=cifar", "data.image_size=16", "data.channels=1",
    "train.batch_size=16", "train.log_every=1", "train.progress=false",
    "train.tensorboard=false", "train.plot=false", "optim.lr=0.4", "parallel.backend=gloo",
]  # fmt: skip
SEGMENT = [  # a U-Net of width 4 on 16x16 crops of 20x20 block files, 2 data ranks
    "train.task=segment", "data.num_classes=3", "data.channels=1", "train.batch_size=2",
    "train.max_steps=2", "train.epochs=1", "train.log_every=1", "train.progress=false",
    "train.tensorboard=false", "train.plot=false", "parallel.backend=gloo",
    "data.image_size=16", "model.width=4",
]  # fmt: skip
VOLUME = [  # MONAI's 3-D U-Net on 8^3 crops of 12^3 NIfTI volumes
    *SEGMENT[:-2], "data.image_size=8", "model.name=monai:UNet",
    "model.kwargs={channels: [4, 8], strides: [2], num_res_units: 1, norm: batch}",
]  # fmt: skip
SIDE = {2: 20, 3: 12}
FORMATS = ("npy", "zarr", "tiff", "nifti")
EXT = {"npy": ".npy", "zarr": ".zarr", "tiff": ".tif", "nifti": ".nii.gz"}


# ---------------------------------------------------------------------------- running a probe
@dataclass
class Run:
    status: int | None
    seconds: float
    output: str
    started: bool  # a rank started (its marker in the output, or run_dir made)
    ended: float = 0.0  # time.monotonic() when every process of the probe was gone


@dataclass
class Result:
    item: str
    name: str
    run: Run
    culprit: str | None  # the file at fault, to be named by the error line
    names_file: bool | None
    verdict: bool
    note: str

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.run.output


def run_cli(args: list[str], run_dir: Path | None, timeout: float,
            while_running: Callable[[subprocess.Popen, str], bool] | None = None,
            wrap: list[str] | None = None, program: list[str] | None = None) -> Run:  # fmt: skip
    """``python -m parallelkit.cli ARGS`` (under ``wrap``, e.g. a user namespace; ``program``
    in place of ``-m parallelkit.cli``, e.g. a script) in a session of its own;
    ``while_running(proc, token)`` is polled until it returns True. Killed, with its whole
    process group, after ``timeout`` seconds."""
    existed = run_dir is not None and run_dir.exists()
    token = f"probe-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PK_PROBE=token, PYTHONWARNINGS="default")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as out:
        start = time.monotonic()
        command = [*(wrap or []), PYTHON, *(program or ["-m", "parallelkit.cli"]), *args]
        proc = subprocess.Popen(command,
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        done = while_running is None
        while proc.poll() is None and time.monotonic() - start < timeout:
            if not done:
                done = while_running(proc, token)
            time.sleep(0.1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        status = proc.wait()
        seconds = time.monotonic() - start
        kill_leftovers(token)
        out.seek(0)
        output = out.read()
    made = run_dir is not None and not existed and run_dir.exists()
    return Run(status, seconds, output, bool(STARTED.search(output)) or made, time.monotonic())


def train(run_dir: Path, *overrides: str, timeout: float = 150, **kw) -> Run:
    return run_cli(["train", f"train.run_dir={run_dir}", *overrides], run_dir, timeout, **kw)


def probe_pids(token: str, rank: int | None = None) -> list[int]:
    """Processes whose environment holds this probe's token (and that are local rank ``rank``:
    its ``RANK`` variable, or its name where it is a fork of the launcher)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PK_PROBE={token}".encode() in environ and (
            rank is None or is_rank(int(entry), rank)
        ):
            found.append(int(entry))
    return found


def kill_leftovers(token: str) -> None:
    for pid in probe_pids(token):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "error:" in line]
    if not lines:  # the last line that is not the final table's
        lines = [ln for ln in output.strip().splitlines() if not ln.startswith(("+", "|"))]
    return lines[-1] if lines else ""


def refused(item: str, name: str, run: Run, culprit: Path | str | None, early: bool = True,
            status: int = 2, message: str = "") -> Result:  # fmt: skip
    """A probe whose fault must stop the job: exit ``status``, no traceback, one error line
    naming ``culprit`` (and holding ``message``), before any rank started where ``early``."""
    line = error_line(run.output)
    names = None if culprit is None else str(culprit) in line
    errors = [ln for ln in run.output.splitlines() if "error:" in ln]
    problems = []
    if run.status != status:
        problems.append(f"exit {run.status}, not {status}")
    if "Traceback" in run.output:
        problems.append("traceback")
    if names is False:
        problems.append("the file is not named")
    if len(errors) != 1:
        problems.append(f"{len(errors)} error lines")
    if early and run.started:
        problems.append("after the ranks started")
    if message and message not in line:
        problems.append(f"no {message!r}")
    note = "; ".join(problems) or ("" if early else "found by the ranks (values), before step 1")
    return Result(item, name, run, str(culprit) if culprit else None, names, not problems, note)


def accepted(item: str, name: str, run: Run, checks: dict[str, bool] | None = None) -> Result:
    """A probe whose job must finish: exit 0, no traceback, and every one of ``checks``."""
    problems = [] if run.status == 0 else [f"exit {run.status}"]
    if "Traceback" in run.output:
        problems.append("traceback")
    problems += [what for what, ok in (checks or {}).items() if not ok]
    return Result(item, name, run, None, None, not problems, "; ".join(problems))


def judged(item: str, name: str, run: Run, checks: dict[str, bool]) -> Result:
    problems = [what for what, ok in checks.items() if not ok]
    if "Traceback" in run.output:
        problems.append("traceback")
    return Result(item, name, run, None, None, not problems, "; ".join(problems))


# ---------------------------------------------------------------------------- data sets
def write(path: Path, a: np.ndarray, fmt: str) -> Path:
    """``a`` stored at ``path`` (its extension added) in ``fmt``; returns the file's path."""
    path = path.with_name(path.name + EXT[fmt])
    if fmt == "npy":
        np.save(path, a, allow_pickle=True)
    elif fmt == "zarr":
        import zarr

        dtype = str if a.dtype.kind == "U" else a.dtype
        z = zarr.create_array(path, shape=a.shape, dtype=dtype, chunks=(8,) * a.ndim)
        z[...] = a
    elif fmt == "tiff":
        import tifffile

        tifffile.imwrite(path, a)
    else:
        import nibabel as nib

        dtype = a.dtype if a.dtype.itemsize == 8 and a.dtype.kind in "iu" else None
        nib.save(nib.Nifti1Image(a, np.eye(4), dtype=dtype), path)
    return path


def blocks(root: Path, fmt: str, image_dtype=np.float32, mask_dtype=np.uint8) -> Path:
    """A block folder (``data.name=FMT:ROOT``): 4 training and 2 test samples, 20x20 images
    (12^3 volumes for NIfTI), masks of labels 0..2."""
    dims = 3 if fmt == "nifti" else 2
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for kind in ("images", "masks"):
            (root / split / kind).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            shape = (SIDE[dims],) * dims
            image = rng.integers(0, 100, shape).astype(image_dtype)
            mask = rng.integers(0, 3, shape).astype(mask_dtype)
            write(root / split / "images" / f"s{i}", image, fmt)
            write(root / split / "masks" / f"s{i}", mask, fmt)
    return root


def block_args(root: Path, fmt: str, *more: str) -> list[str]:
    return [*(VOLUME if fmt == "nifti" else SEGMENT), f"data.name={fmt}:{root}", *more]


def image(root: Path, fmt: str, split: str = "train", kind: str = "images", i: int = 1) -> Path:
    return root / split / kind / f"s{i}{EXT[fmt]}"


# ---------------------------------------------------------------------------- probe families
class Sink(list):
    """The results: each printed as it comes, and the table written so far to ``out``."""

    def __init__(self, out: Path):
        super().__init__()
        self.out = out

    def append(self, r: Result) -> None:
        super().append(r)
        print(f"{'pass' if r.verdict else 'FAIL'} [{r.item}] {r.name} "
              f"(exit {r.run.status}, {r.run.seconds:.1f} s) {r.note}", flush=True)
        self.out.write_text(table(self) + "\n")


class Probes(PredictProbes):
    def __init__(self, tmp: Path, sink: Sink):
        self.tmp = tmp
        self.count = 0
        self.sink = sink

    def dir(self, name: str) -> Path:
        self.count += 1
        path = self.tmp / f"{self.count:03d}-{re.sub(r'[^A-Za-z0-9.-]+', '-', name)}"
        path.mkdir()
        return path

    # 1. overwrite deletes nothing outside run_dir, nothing the run did not write -------------
    def overwrite(self) -> list[Result]:
        results = self.sink
        for variant in ("samples/ links outside run_dir", "samples/ of a classify run"):
            d = self.dir(variant)
            run_dir = d / "run"
            first = train(run_dir, *TINY, "train.max_steps=2")
            if first.status != 0:
                results.append(accepted("1", f"overwrite: {variant} (first run)", first))
                continue
            if "links" in variant:
                outside = d / "elsewhere"
                outside.mkdir()
                (run_dir / "samples").symlink_to(outside, target_is_directory=True)
            else:
                outside = run_dir / "samples"
                outside.mkdir()
            theirs = [outside / f"epoch-{k:03d}.png" for k in (1, 2)]
            for p in theirs:
                p.write_bytes(b"the user's")
            run = train(run_dir, *TINY, "train.max_steps=2", "train.overwrite=true")
            results.append(accepted("1", f"overwrite: {variant}", run, {
                "user's epoch-*.png deleted": all(p.is_file() for p in theirs),
                "the link was removed": "links" not in variant
                or (run_dir / "samples").is_symlink(),
            }))  # fmt: skip
        return results

    # 2. dtypes: refused in one line naming the file, or accepted and trained -------------------
    def dtypes(self) -> list[Result]:
        refused_dtypes = {
            "npy": ["complex64", "complex128", "object", "<U2", "bool"],
            "zarr": ["complex64", "complex128", "bool", "<U2"],
            "tiff": ["complex64", "bool"],
            "nifti": ["complex64", "complex128"],
        }
        accepted_dtypes = {
            "npy": ["int8", "uint16", "uint32", "int64", "uint64", "float16", "float64"],
            "zarr": ["int16", "uint64", "float16"],
            "tiff": ["int8", "uint32", "float16"],
            "nifti": ["int16", "int64", "float64"],
        }
        results = self.sink
        for fmt in FORMATS:
            for dtype in refused_dtypes[fmt]:
                d = self.dir(f"{fmt}-{dtype}")
                root = blocks(d / "data", fmt)
                bad = image(root, fmt)
                a = np.ones((SIDE[3 if fmt == "nifti" else 2],) * (3 if fmt == "nifti" else 2))
                if dtype == "object":
                    a = np.array([[{"x": 1}] * a.shape[1]] * a.shape[0], dtype=object)
                shutil.rmtree(bad) if bad.is_dir() else bad.unlink()
                write(bad.with_name("s1"), a.astype(dtype) if dtype != "object" else a, fmt)
                run = train(d / "run", *block_args(root, fmt))
                results.append(refused("2", f"{fmt}: {dtype} image refused", run, bad))
            for dtype in accepted_dtypes[fmt]:
                d = self.dir(f"{fmt}-{dtype}-ok")
                root = blocks(d / "data", fmt, image_dtype=np.dtype(dtype))
                run = train(d / "run", *block_args(root, fmt))
                results.append(accepted("2", f"{fmt}: {dtype} images train", run))
        return results

    # 3. checkpoints: fallback, no collision, nothing deleted ----------------------------------
    def checkpoints(self) -> list[Result]:
        common = [*TINY, "train.checkpoint_every=2", "train.keep_checkpoints=6",
                  "optim.schedule=constant", "optim.warmup_epochs=0"]  # fmt: skip
        base = self.dir("checkpoint-base") / "run"
        first = train(base, *common, "train.max_steps=4")
        if first.status != 0:
            self.sink.append(accepted("3", "checkpoints (first run)", first))
            return self.sink
        results = self.sink
        for variant in ("unreadable (mode 000)", "shard with flipped bytes",
                        "shard of garbage", "manifest.json a directory"):  # fmt: skip
            run_dir = self.dir(variant) / "run"
            shutil.copytree(base, run_dir, symlinks=True)
            step4 = run_dir / "checkpoints" / "step-000000004"
            wrap = None
            if variant.startswith("unreadable"):
                wrap = as_a_user()
                if wrap is None:
                    continue
                os.chown(step4, 54321, 54321)
                step4.chmod(0)
            elif variant == "shard with flipped bytes":
                shard = step4 / "shard-0.pt"
                data = bytearray(shard.read_bytes())
                for k in range(len(data) // 2, len(data) // 2 + 64):
                    data[k] ^= 0xFF
                shard.write_bytes(bytes(data))
            elif variant == "shard of garbage":
                (step4 / "shard-0.pt").write_bytes(b"garbage " * 100)
            else:
                manifest = step4 / "manifest.json"
                manifest.unlink()
                manifest.mkdir()
            before = contents(run_dir / "checkpoints")
            one = train(run_dir, *common, "train.max_steps=6", "--resume", wrap=wrap)
            after_one = contents(run_dir / "checkpoints")
            two = train(run_dir, *common, "train.max_steps=8", "--resume", wrap=wrap)
            if step4.exists() or any(run_dir.glob("checkpoints/*step-000000004*")):
                for p in run_dir.glob("checkpoints/*step-000000004*"):
                    p.chmod(0o755)
            after = contents(run_dir / "checkpoints")
            for which, run, kept in (("resume", one, after_one), ("resume again", two, after)):
                results.append(judged("3", f"{variant}: {which}", run, {
                    f"exit {run.status}": run.status == 0,
                    "no fallback to step 2": which == "resume again"
                    or "resumed at step 2" in run.output,
                    "a checkpoint was deleted": before <= kept,
                }))  # fmt: skip
        return results

    # 4 and 6. files no library can read: one line naming the file ---------------------------
    def unreadable_files(self) -> list[Result]:
        results = self.sink

        def case(item: str, fmt: str, name: str, damage: Callable[[Path], Path],
                 early: bool = True, split: str = "train") -> None:  # fmt: skip
            d = self.dir(f"{fmt}-{name}")
            root = blocks(d / "data", fmt)
            bad = damage(image(root, fmt, split))
            run = train(d / "run", *block_args(root, fmt))
            results.append(refused(item, f"{fmt}: {name}", run, bad, early=early))

        def zarr_chunk(path: Path) -> Path:
            chunks = sorted(p for p in (path / "c").rglob("*") if p.is_file())
            chunks[0].write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 10)  # zstd magic, then junk
            return path

        def cut(fraction: float) -> Callable[[Path], Path]:
            def damage(path: Path) -> Path:
                data = path.read_bytes()
                path.write_bytes(data[: int(len(data) * fraction)])
                return path

            return damage

        def garbage(path: Path) -> Path:
            if path.is_dir():
                shutil.rmtree(path)
                path.mkdir()
                (path / "zarr.json").write_text("{not json")
            else:
                path.write_bytes(b"not what the name says " * 20)
            return path

        def nii(path: Path) -> Path:  # an uncompressed .nii beside, truncated in its data
            import nibabel as nib

            img = nib.load(path)
            a = np.asarray(img.dataobj)
            path.unlink()
            new = path.with_name("s1.nii")
            nib.save(nib.Nifti1Image(a, np.eye(4)), new)
            return cut(0.6)(new)

        def striped(path: Path) -> Path:  # a zlib TIFF whose strip is cut short
            import tifffile

            tifffile.imwrite(path, np.ones((20, 20), np.float32), compression="zlib",
                             rowsperstrip=20)  # fmt: skip
            page = tifffile.TiffFile(path).pages[0]
            offset, count = page.dataoffsets[0], page.databytecounts[0]
            data = bytearray(path.read_bytes())
            data[offset : offset + count] = b"\x00" * count
            path.write_bytes(bytes(data))
            return path

        def raw_strip(path: Path) -> Path:  # an uncompressed TIFF whose strip is past the end
            import tifffile

            tifffile.imwrite(path, np.ones((20, 20), np.float32))
            return cut(0.7)(path)

        case("4", "zarr", "corrupt zstd chunk (train image)", zarr_chunk, early=False)
        case("4", "zarr", "corrupt zstd chunk (test image)", zarr_chunk, early=False, split="test")
        case("4", "nifti", ".nii.gz truncated", cut(0.5))
        case("4", "nifti", ".nii truncated in its data", nii)
        case("4", "nifti", "garbage .nii.gz", garbage)
        case("6", "npy", "truncated data (mmap length)", cut(0.5))
        case("6", "npy", "truncated header", cut(0.05))
        case("6", "zarr", "zarr.json not JSON", garbage)
        case("6", "tiff", "not a TIFF file", garbage)
        case("6", "tiff", "zlib strip of zeros", striped, early=False)
        case("6", "tiff", "strip past the end of the file", raw_strip)
        case("6", "npy", "garbage .npy in the test split", garbage, split="test")
        return results

    # 4 and 7. parallelkit plan ----------------------------------------------------------------
    def plan(self) -> list[Result]:
        base = ["plan", "--model", "resnet18", "--image-size", "32", "--batch", "8", "--ranks",
                "2", "--cores", "1"]  # fmt: skip
        results = self.sink
        for name, more, item, message in (
            ("--model-kwargs unknown argument", ["--model-kwargs", "{bogus_arg: 1}"], "4",
             "bogus_arg"),
            ("--model-kwargs invalid YAML", ["--model-kwargs", "{bad: [1"], "4", ""),
            ("--bandwidth -1", ["--bandwidth", "-1", "--latency", "5"], "7", "bandwidth"),
            ("--latency -1", ["--bandwidth", "10", "--latency", "-1"], "7", "latency"),
        ):  # fmt: skip
            run = run_cli([*base, *more], None, 120)
            result = refused(item, f"plan {name}", run, None, message=message)
            if run.seconds > 5:
                result.verdict, result.note = False, f"refused after {run.seconds:.1f} s"
            results.append(result)
        return results

    # 5. faults in masks and configs: one line, no traceback on any rank ---------------------
    def masks(self) -> list[Result]:
        results = self.sink

        def case(name: str, split: str, mask: Callable[[np.ndarray], np.ndarray] | None,
                 raw: bytes | None = None, fmt: str = "npy", ok: bool = False) -> None:  # fmt: skip
            d = self.dir(f"mask-{split}-{name}")
            root = blocks(d / "data", fmt)
            bad = image(root, fmt, split, "masks", 0)
            if raw is not None:
                bad.write_bytes(raw)
            else:
                a = np.load(bad)
                bad.unlink()
                write(bad.with_name("s0"), mask(a), fmt)
            run = train(d / "run", *block_args(root, fmt))
            if ok:
                results.append(accepted("5", f"{split} mask: {name}", run))
            else:
                early = raw is not None
                results.append(refused("5", f"{split} mask: {name}", run, bad, early=early))

        for split in ("train", "test"):
            case("label 3 = num_classes", split, lambda m: np.where(m == 2, 3, m))
            case("label -1 (int16)", split, lambda m: m.astype(np.int16) - 1)
            case("float, non-integer", split, lambda m: m.astype(np.float32) + 0.5)
            case("corrupt file", split, None, raw=b"\x93NUMPY garbage" * 8)
        case("255 (the ignore index)", "train", lambda m: np.where(m == 2, 255, m), ok=True)
        case("float, integer values", "train", lambda m: m.astype(np.float32), ok=True)
        case("bool", "train", lambda m: m > 0, ok=True)
        return results

    def late_configs(self) -> list[Result]:
        results = self.sink
        d = self.dir("nifti-volumes")
        root = blocks(d / "data", "nifti")
        npy = blocks(self.dir("npy-images") / "data", "npy")
        for name, args, message in (
            ("crop larger than the volume", block_args(root, "nifti", "data.image_size=16"),
             "does not fit"),
            ("crop larger than the image", block_args(npy, "npy", "data.image_size=24"),
             "does not fit"),
            ("depth 1 split over 2 ranks", block_args(root, "nifti", "data.image_size=[1, 8, 8]",
             "parallel.strategy=spatial", "parallel.depth=2"), "parallel.depth=2"),
            ("2 rows split over 2x2 ranks", block_args(npy, "npy", "data.crop=[1, 16]",
             "parallel.strategy=spatial", "parallel.rows=2"), "parallel.rows=2"),
            ("parallel.backend=nccl", [*TINY[:-1], "parallel.backend=nccl"], "needs a GPU"),
            ("parallel.device=cuda", [*TINY, "parallel.device=cuda"], "needs a GPU"),
        ):  # fmt: skip
            run = train(self.dir(name) / "run", *args)
            results.append(refused("5", name, run, None, message=message))
        return results

    # 7. wording ------------------------------------------------------------------------------
    def wording(self) -> list[Result]:
        results = self.sink
        long = [*TINY, "train.max_steps=400", "parallel.timeout=10"]

        def stop_rank_1(signum: int) -> Callable[[subprocess.Popen, str], bool]:
            def act(proc: subprocess.Popen, token: str) -> bool:
                metrics = run_dir / "metrics.jsonl"
                if not metrics.is_file() or metrics.read_text().count('"kind": "train"') < 2:
                    return False
                pids = probe_pids(token, rank=1)
                if pids:
                    os.kill(max(pids), signum)
                    act.at = time.monotonic()
                return bool(pids)

            return act

        run_dir = self.dir("sigkill") / "run"
        act = stop_rank_1(signal.SIGKILL)
        run = train(run_dir, *long, while_running=act, timeout=120)
        results.append(judged("7", "rank 1 killed by SIGKILL: wording", run, {
            "'exit status killed by'": "exit status killed by" not in run.output,
            "rank 1 not named as killed by SIGKILL": "rank 1 failed first (killed by SIGKILL)"
            in run.output,
        }))  # fmt: skip

        run_dir = self.dir("sigstop") / "run"
        act = stop_rank_1(signal.SIGSTOP)
        run = train(run_dir, *long, while_running=act, timeout=150)
        gone = run.ended - act.at if hasattr(act, "at") else float("nan")
        docs = (ROOT / "docs" / "training.md").read_text()
        said = re.search(r"\(([\d.]+) s with `parallel.timeout=10`", docs)
        results.append(judged("7", "rank 1 stopped by SIGSTOP: timing", run, {
            "rank 1 not named": "rank 1 (its process is stopped" in run.output,
            f"{gone:.1f} s from SIGSTOP to gone, docs say {said and said[1]}":
                bool(said) and 10 <= gone <= float(said[1]) + 5,
        }))  # fmt: skip
        results[-1].note = results[-1].note or f"{gone:.1f} s from SIGSTOP to gone"

        mount = self.dir("read-only mount") / "ro"
        mount.mkdir()
        command = f'mount -t tmpfs -o ro tmpfs "{mount}" && exec "$@"'
        wrap = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command, "sh"]
        run = train(mount / "run", *TINY, "train.max_steps=2", wrap=wrap, timeout=60)
        results.append(refused("7", "run_dir on a read-only mount", run, None,
                               message="read-only file system"))  # fmt: skip

        results.append(self.rejected_pickle())
        return results

    def rejected_pickle(self) -> Result:
        """The newest checkpoint's shard replaced by a pickle that ``weights_only`` refuses
        (its manifest's SHA-256 made to match): reported in one line, no torch warnings."""
        common = [*TINY, "train.checkpoint_every=2", "train.keep_checkpoints=6"]
        run_dir = self.dir("rejected pickle") / "run"
        first = train(run_dir, *common, "train.max_steps=4")
        if first.status != 0:
            return accepted("7", "rejected pickle (first run)", first)
        folder = run_dir / "checkpoints" / "step-000000004"
        shard = folder / "shard-0.pt"
        script = f"import torch, collections; torch.save({{'x': collections.Counter('ab'), " \
                 f"'f': print}}, {str(shard)!r})"  # fmt: skip
        subprocess.run([PYTHON, "-c", script], check=True)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["sha256"]["shard-0.pt"] = hashlib.sha256(shard.read_bytes()).hexdigest()
        (folder / "manifest.json").write_text(json.dumps(manifest))
        run = train(run_dir, *common, "train.max_steps=6", "--resume")
        return judged("7", "rejected pickle in a checkpoint", run, {
            f"exit {run.status}": run.status == 0,
            "torch warnings printed": "UserWarning" not in run.output,
            "not reported": "not a parallelkit train checkpoint" in run.output
            or "step-000000004" in run.output,
        })  # fmt: skip


def contents(folder: Path) -> set[str]:
    """SHA-256 of every file under ``folder`` (a checkpoint moved aside keeps its hashes)."""
    found = set()
    for p in folder.rglob("*"):
        try:
            if p.is_file():
                found.add(hashlib.sha256(p.read_bytes()).hexdigest())
        except OSError:
            found.add(f"unreadable:{p.relative_to(folder)}")
    return found


def as_a_user() -> list[str] | None:
    """A prefix that runs a command where file modes apply (root is mapped into a user
    namespace, as tests/jobs.py does); None where that is not possible."""
    if os.geteuid() != 0:
        return []
    ok = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True)
    return ["unshare", "--user", "--map-root-user"] if ok.returncode == 0 else None


# ---------------------------------------------------------------------------- the report
FAMILIES = {
    "1": ["overwrite"],
    "2": ["dtypes"],
    "3": ["checkpoints"],
    "4": ["unreadable_files", "plan"],
    "5": ["masks", "late_configs"],
    "6": ["unreadable_files"],
    "7": ["plan", "wording"],
    "predict": ["predict_outputs"],
    "startup": ["startup"],
}


def table(results: list[Result]) -> str:
    def mark(v: bool | None) -> str:
        return "" if v is None else ("yes" if v else "no")

    rows = ["| # | item | probe | exit | s | traceback | names file | before ranks | verdict | "
            "note / last line |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for k, r in enumerate(results, 1):
        last = error_line(r.run.output).replace("|", "\\|")[:160]
        note = (r.note + " — " if r.note else "") + f"`{last}`"
        rows.append(
            f"| {k} | {r.item} | {r.name} | {r.run.status} | {r.run.seconds:.1f} | "
            f"{mark(r.traceback)} | {mark(r.names_file)} | {mark(not r.run.started)} | "
            f"{'pass' if r.verdict else '**FAIL**'} | {note} |"
        )
    passed = sum(r.verdict for r in results)
    rows.append(f"\n{passed} of {len(results)} probes pass.")
    return "\n".join(rows)


ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/fault_probes.md", help="the markdown table")
    parser.add_argument("--only", nargs="*", choices=sorted(FAMILIES), help="items to probe")
    parser.add_argument("--family", nargs="*", help="probe families by method name")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    names = args.family or list(dict.fromkeys(
        m for item, methods in FAMILIES.items() if not args.only or item in args.only
        for m in methods))  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="fault-probes-"))
    results = Sink(Path(args.out))
    probes = Probes(tmp, results)
    try:
        for name in names:
            try:
                getattr(probes, name)()
            except Exception as e:  # a probe that could not be set up: said, the others go on
                print(f"probe family {name} stopped: {type(e).__name__}: {e}", flush=True)
                failed = Run(None, 0.0, f"probe script: {type(e).__name__}: {e}", False)
                results.append(Result("?", f"{name} (set-up failed)", failed, None, None,
                                      False, "the probe script failed"))  # fmt: skip
    finally:
        if not args.keep:
            for p in tmp.rglob("*"):  # the unreadable checkpoint, given back its mode
                if p.is_dir() and not p.is_symlink():
                    p.chmod(0o755)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")
    text = table(results)
    print(text)
    Path(args.out).write_text(text + "\n")
    return 0 if all(r.verdict for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
