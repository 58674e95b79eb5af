"""Every shell command the docs show is run here, or says why not.

The docs are README.md, docs/*.md and examples/*/README.md; their commands are the lines of
their ```bash blocks (a line ending in a backslash continues on the next, and so does an open
quote). Each command is one of:

- ``parallelkit train ...`` (also ``.venv/bin/parallelkit``, ``python -m parallelkit.cli``,
  and under ``torchrun``, ``mpiexec -n N`` or ``srun``): run here with ``--check`` added, the
  dry run that checks the config, the grid, the data and the model built on the meta device
  and writes no run; ``train.run_dir`` in a temporary folder; under a launcher, with
  ``parallel.ranks`` set to the ranks the launcher would start (``-n``, ``--ntasks``,
  ``--nproc-per-node`` x ``--nnodes``, ``-N`` x ``--ntasks-per-node``). A data folder the
  command reads (``/data/ct``, ``runs/data/shapes-1024``, ...) is replaced by a small stand-in
  of the same layout (:data:`STAND_INS`), a user's own model module by a stand-in module
  (:data:`STAND_IN_MODULES`). A ``model.name`` of a library not installed here (timm, smp)
  skips the check, saying so.
- ``make TARGET``: ``make -n TARGET`` shows that the target exists (nothing is built).
- anything else carries a comment that says why this test does not run it:

      # illustrative: WHY (a GPU cluster, a TPU VM, your own data)
      # run by tests/FILE.py::TEST       a test runs it, or a smaller version of it
      # checked by tests/FILE.py::TEST   a test checks it without running it

  The comment ends the command's own line, or stands on a line of its own, where it covers the
  commands right below it, up to the next blank or comment line. ``illustrative:`` needs a
  reason; a named test must exist. A ``parallelkit train`` is checked even when a comment line
  covers it; only a comment on its own line stops the check.

A command that is neither run nor marked fails the test, which names its file and line.
docs/contributing.md ("Commands in the docs") says the same for writers of docs.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")]
)
SHELLS = ("bash", "sh", "shell")
MARKER = re.compile(
    r"#.*?\b(illustrative:\s*(?P<why>\S.*)"
    r"|(run|checked) by (?P<test>tests/\S+?\.py)(::(?P<name>\w+))?)"
)
LAUNCHERS = ("torchrun", "mpiexec", "mpirun", "srun")
# Variables of torchrun, mpiexec and Slurm: a check run inside one of their jobs (this test
# under mpiexec, say) must still see a plain process.
LAUNCHER_VARS = re.compile(
    r"^(WORLD_SIZE|RANK|LOCAL_RANK|MASTER_PORT|MASTER_ADDR|TORCHELASTIC_\w+|PMI_\w+|PMIX_\w+"
    r"|OMPI_\w+|MPI_LOCAL\w+|SLURM_\w+|PARALLELKIT_STARTED)$"
)
# model.name prefix -> the module it needs; a command naming one not installed is skipped.
LIBRARIES = {"timm:": "timm", "smp:": "segmentation_models_pytorch", "torchvision:": "torchvision",
             "monai:": "monai"}  # fmt: skip


@dataclass
class Command:
    """One shell command of a doc: its words (continuations joined, comments gone), where it
    starts, and the marker that covers it, if any."""

    doc: Path
    line: int
    text: str
    words: list[str]
    marker: re.Match | None = None
    own_line: bool = False  # the marker is on the command's own lines
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def split_comment(line: str) -> tuple[str, str]:
    """``line`` as (code, comment): the comment starts at a ``#`` that begins a word outside
    quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i:]
    return line, ""


def complete(code: str) -> bool:
    """Whether ``code`` is a whole command: no continuation, no quote left open."""
    if code.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(code)
    except ValueError:
        return False
    return True


def blocks(doc: Path) -> Iterator[list[tuple[int, str]]]:
    """The lines of each shell block of ``doc``, with their line numbers."""
    fence, block = None, []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith("```"):
                fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
                info = stripped[len(fence) :].split()
                shell, block = bool(info) and info[0] in SHELLS, []
        elif stripped == fence:
            if shell:
                yield block
            fence = None
        else:
            block.append((number, line))


def commands(doc: Path) -> Iterator[Command]:
    """The commands of ``doc``'s shell blocks; ``for V in A B; do ... done`` repeats the lines
    inside once per value, with ``$V`` replaced."""
    for block in blocks(doc):
        group = None  # the marker of a comment line: it covers the commands right below it
        loop: tuple[str, list[str]] | None = None
        i = 0
        while i < len(block):
            start, line = block[i]
            code, comment = split_comment(line)
            i += 1
            if not code.strip():  # a blank line or a comment line ends a group
                group = MARKER.search(comment)
                continue
            comments = [comment]
            while not complete(code) and i < len(block):
                code = code.rstrip().removesuffix("\\").rstrip() + " " + block[i][1].strip()
                i += 1
                code, more = split_comment(code)
                comments.append(more)
            head = re.fullmatch(r"\s*for (\w+) in ([^;]+); do\s*", code)
            if head:
                loop = (head.group(1), head.group(2).split())
                continue
            if code.strip() == "done":
                loop = None
                continue
            own = next(filter(None, map(MARKER.search, comments)), None)
            for value in loop[1] if loop else [None]:
                text = code.strip()
                if value is not None:
                    text = re.sub(rf"\$\{{?{loop[0]}\}}?\b", value, text)
                words = shlex.split(text)
                env = {}
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    key, _, val = words.pop(0).partition("=")
                    env[key] = val
                yield Command(doc, start, text, words, own or group, own is not None, env)


ALL = [c for doc in DOCS for c in commands(doc)]


# --- what a command is ------------------------------------------------------------------------


def train_args(words: list[str]) -> list[str] | None:
    """The arguments after ``train`` of a ``parallelkit train`` command, else None."""
    for i, word in enumerate(words[1:], 1):
        before = words[i - 1]
        if word == "train" and (Path(before).name == "parallelkit" or before == "parallelkit.cli"):
            return words[i + 1 :]
    return None


def option(words: list[str], *names: str) -> int | None:
    """The integer value of the first of ``names`` in ``words`` (``--n 4`` or ``--n=4``)."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return int(words[i + 1])
            if word.startswith(name + "="):
                return int(word.split("=", 1)[1])
    return None


def launcher_ranks(words: list[str]) -> int | None:
    """The ranks a launcher at the start of ``words`` would start; None without one."""
    name = Path(words[0]).name
    if name not in LAUNCHERS:
        return None
    if name == "torchrun":
        per_node = option(words, "--nproc-per-node", "--nproc_per_node") or 1
        return per_node * (option(words, "--nnodes") or 1)
    if name in ("mpiexec", "mpirun"):
        ranks = option(words, "-n", "-np")
        assert ranks, f"{' '.join(words)}: mpiexec without -n"
        return ranks
    tasks = option(words, "--ntasks", "-n")
    if tasks:
        return tasks
    return (option(words, "-N", "--nodes") or 1) * (option(words, "--ntasks-per-node") or 1)


def check_argv(command: Command, run_dir: Path) -> list[str]:
    """``parallelkit train``'s arguments for the command's dry run."""
    args = [a for a in train_args(command.words) if a != "--check"]
    ranks = launcher_ranks(command.words)
    if ranks is not None:  # the launcher decides: it would start this many ranks
        args = [a for a in args if not a.startswith("parallel.ranks=")]
        args.append(f"parallel.ranks={ranks}")
    return ["--check", *args, f"train.run_dir={run_dir}"]


# --- data stand-ins ---------------------------------------------------------------------------


def zarr_store(root: Path, side: int, test_side: int, channels: int, dims: int, train: int,
               test: int = 1) -> None:  # fmt: skip
    """A store of the layout of ``examples/common/shapes_store.py`` whose arrays have headers
    and no chunks written: they read as zeros, one missing chunk each (``--check`` reads the
    headers, and every training image once for the normalization statistics)."""
    import zarr

    for split, n, s in (("train", train, side), ("test", test, test_side)):
        for i in range(n):
            shape = (s,) * dims
            image = (channels, *shape) if channels > 1 or dims == 2 else shape
            for kind, shp in (("images", image), ("masks", shape)):
                path = root / split / kind / f"s{i:04d}.zarr"
                zarr.create_array(str(path), shape=shp, chunks=shp, dtype="uint8")


def nifti_folder(root: Path, side: int, train: int, test: int = 1) -> None:
    """``root/{train,test}/{images,masks}/*.nii.gz``: zero volumes of ``side``^3."""
    nib = pytest.importorskip("nibabel")
    volume = np.zeros((side,) * 3, np.uint8)
    for split, n in (("train", train), ("test", test)):
        for kind in ("images", "masks"):
            (root / split / kind).mkdir(parents=True)
            for i in range(n):
                nib.save(nib.Nifti1Image(volume, np.eye(4)), root / split / kind / f"s{i}.nii.gz")


def png_folder(root: Path, train: int, test: int = 2) -> None:
    """``root/{train,test}/{images,masks}/*.png``, the segfolder layout, 8x8 pixels."""
    from PIL import Image

    for split, n in (("train", train), ("test", test)):
        for kind, mode in (("images", "RGB"), ("masks", "L")):
            (root / split / kind).mkdir(parents=True)
            for i in range(n):
                Image.new(mode, (8, 8)).save(root / split / kind / f"s{i}.png")


def cifar_folder(root: Path, per_batch: int) -> None:
    """A ``cifar-10-batches-py`` directory of ``per_batch`` images per batch file."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": [i % 10 for i in range(per_batch)]}  # fmt: skip
        (root / name).write_bytes(pickle.dumps(batch))


def shards(root: Path, train: int) -> None:
    """WebDataset shards as ``parallelkit data shard`` writes them: generated images, 3x32x32
    like the docs' digits, ``train`` for training and 16 for testing."""
    from parallelkit.data.shard import shard_main

    with redirect_stdout(io.StringIO()):
        assert shard_main(["synthetic", str(root), "--samples-per-shard", "32", "--train-samples",
                           str(train), "--test-samples", "16"]) == 0  # fmt: skip


MYNETS = """
from torch import nn


class UNet3D(nn.Sequential):
    \"\"\"A stand-in for the docs' own network: the arguments they name, one 3-D block.\"\"\"

    def __init__(self, in_channels, out_channels, width=8):
        super().__init__(nn.Conv3d(in_channels, width, 3, padding=1), nn.BatchNorm3d(width),
                         nn.ReLU(), nn.Conv3d(width, out_channels, 1))
"""


# The data folders of the docs' commands -> a function that writes a stand-in of ``n`` training
# samples there: the layout, sizes and channels of the data the docs describe (a CT volume has
# one channel, a slide three), and as many samples as the command's batch needs.
STAND_INS: dict[str, Callable[[Path, int], None]] = {
    "runs/data/shapes-1024": lambda p, n: zarr_store(p, 1024, 2048, 3, 2, train=n),
    "runs/data/volumes-128": lambda p, n: zarr_store(p, 128, 128, 3, 3, train=n),
    "/data/slides": lambda p, n: zarr_store(p, 2048, 2048, 3, 2, train=n),
    "/data/ct": lambda p, n: nifti_folder(p, 128, train=n),
    "~/data/cells": lambda p, n: png_folder(p, train=n),
    "~/cifar-10-batches-py": lambda p, n: cifar_folder(p, per_batch=-(-n // 5)),
    "shards": lambda p, n: shards(p, n),
}
MYDATA = """
from torch.utils.data import Dataset

from parallelkit.data.shapes import ShapesDataset


class Scenes(Dataset):
    \"\"\"A stand-in for the docs' own data set: generated scenes with masks, whole.\"\"\"

    def __init__(self, split, count=64):
        self.inner = ShapesDataset(count, 32, 3, 4, base=0 if split == "train" else 1000)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]
"""
# Modules of the docs' ``model.name=`` and ``data.name=MODULE:CLASS`` that a user writes -> a
# stand-in's source.
STAND_IN_MODULES = {"mynets": MYNETS, "mydata": MYDATA}


def data_paths(args: list[str], config: str | None) -> set[str]:
    """The data folders the arguments (and the YAML file's ``data`` keys) name."""
    keys = {}
    if config:
        data = (yaml.safe_load((ROOT / config).read_text()) or {}).get("data") or {}
        keys = {f"data.{k}": str(data[k]) for k in ("name", "root") if data.get(k)}
    keys.update(a.partition("=")[::2] for a in args if a.startswith(("data.name=", "data.root=")))
    return {value.split(":", 1)[-1].rstrip("/") for value in keys.values()}


def with_stand_ins(argv: list[str], folder: Path) -> list[str]:
    """``argv`` with each data folder of :data:`STAND_INS` written under ``folder`` and named
    in its place (a YAML file's folder by an added ``data.name``)."""
    from parallelkit.train import config as configs

    config = argv[argv.index("--config") + 1] if "--config" in argv else None
    paths = data_paths(argv, config) & set(STAND_INS)
    if not paths:
        return argv
    overrides = [a for a in argv if "=" in a]
    batch = configs.load(str(ROOT / config) if config else None, overrides).train.batch_size
    out = list(argv)
    for path in sorted(paths):
        target = folder / f"{Path(path).name}-{batch}"
        if not target.exists():
            STAND_INS[path](target, batch)
        names = [i for i, a in enumerate(out) if a.startswith(("data.name=", "data.root="))
                 and a.partition("=")[2].split(":", 1)[-1].rstrip("/") == path]  # fmt: skip
        for i in names:
            key, _, value = out[i].partition("=")
            out[i] = f"{key}={value.split(':', 1)[0] + ':' if ':' in value else ''}{target}"
        if not names:  # the YAML file names it
            prefix = re.search(rf"(\w+):{re.escape(path)}", (ROOT / config).read_text()).group(1)
            out.insert(len(out) - 1, f"data.name={prefix}:{target}")
    return out


# --- the tests --------------------------------------------------------------------------------

TRAIN = [c for c in ALL if train_args(c.words) is not None and not c.own_line]
MAKE = [c for c in ALL if c.words[:1] == ["make"] and c.marker is None]


def test_the_docs_have_commands():
    """The parser finds the blocks (a parser that finds nothing would pass everything)."""
    assert len(ALL) > 100 and len(TRAIN) > 30, (len(ALL), len(TRAIN))
    readme = [c for c in ALL if c.doc.name == "README.md" and c.doc.parent == ROOT]
    assert readme[0].words == ["make", "run"]


SAMPLE = """
```bash
# illustrative: covers the two commands below it
echo one
echo two
# a plain comment ends the group
echo three
parallelkit train parallel.rows=2 \\
    train.epochs=1      # run by tests/test_doc_commands.py::test_the_parser
for r in 1 2; do
  torchrun --nnodes 2 --nproc-per-node 4 -m parallelkit.cli train parallel.ranks=$r
done
```

```python
print("not a shell block")
```
"""


def test_the_parser(tmp_path):
    """Groups, comments at the end of a command, continuations and loops, on a sample doc."""
    doc = tmp_path / "sample.md"
    doc.write_text(SAMPLE)
    found = list(commands(doc))
    assert [c.text for c in found[:3]] == ["echo one", "echo two", "echo three"]
    assert [c.marker is not None for c in found[:3]] == [True, True, False]  # three: unmarked
    train = found[3]
    assert train.line == 8 and train.own_line and train.marker.group("name") == "test_the_parser"
    assert train_args(train.words) == ["parallel.rows=2", "train.epochs=1"]
    loop = found[4:]
    assert [train_args(c.words) for c in loop] == [["parallel.ranks=1"], ["parallel.ranks=2"]]
    assert check_argv(loop[0], tmp_path)[-2:] == ["parallel.ranks=8", f"train.run_dir={tmp_path}"]


def test_every_command_is_run_or_marked():
    unmarked = [
        f"{c.where}: {c.text}" for c in ALL if c.marker is None and c not in TRAIN and c not in MAKE
    ]
    assert not unmarked, (
        "commands in the docs that no test runs: add `# illustrative: WHY` or "
        "`# run by tests/FILE.py::TEST` (tests/test_doc_commands.py says where)\n"
        + "\n".join(unmarked)
    )


def test_markers_name_tests_that_exist():
    wrong = []
    for c in ALL:
        if c.marker is None or c.marker.group("test") is None:
            continue
        path, name = ROOT / c.marker.group("test"), c.marker.group("name")
        if not path.is_file() or (name and f"def {name}(" not in path.read_text()):
            wrong.append(f"{c.where}: {c.marker.group(0)}")
    assert not wrong, "markers naming tests that do not exist:\n" + "\n".join(wrong)


def test_make_targets_exist():
    for target in sorted({c.words[1] for c in MAKE}):
        proc = subprocess.run(["make", "-n", target], capture_output=True, text=True, cwd=ROOT,
                              timeout=60)  # fmt: skip
        assert proc.returncode == 0, (target, proc.stderr)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.mark.parametrize("command", TRAIN, ids=lambda c: c.where)
def test_train_command_passes_the_check(command, tmp_path, stand_ins, monkeypatch):
    """The dry run of the command, in this process (``parallelkit.cli.train``): about 0.3 s
    each, where a new interpreter costs 2 s. The free space the run needs is this machine's
    matter, not the command's (a wide example needs 1.2 GB), so the check of the run
    directory here looks at everything but the space."""
    from parallelkit import cli
    from parallelkit.train.loop import preflight

    check_run_dir = preflight.check_run_dir
    monkeypatch.setattr(preflight, "check_run_dir", lambda run_dir, need: check_run_dir(run_dir, 0))

    argv = check_argv(command, tmp_path / "run")
    loose = [a for i, a in enumerate(argv) if "=" not in a and not a.startswith("-")
             and argv[i - 1] != "--config"]  # fmt: skip
    assert not loose, f"{command.where}: {loose} are not key=value (quote a value with spaces)"
    for prefix, module in LIBRARIES.items():
        if any(a.startswith(f"model.name={prefix}") for a in argv):
            pytest.importorskip(module, reason=f"{command.where} needs {module}")
    for module, source in STAND_IN_MODULES.items():
        if any(a.startswith((f"model.name={module}:", f"data.name={module}:")) for a in argv):
            (stand_ins / f"{module}.py").write_text(source)
            monkeypatch.syspath_prepend(str(stand_ins))
    argv = with_stand_ins(argv, stand_ins)
    for key in list(os.environ):
        if LAUNCHER_VARS.match(key):
            monkeypatch.delenv(key)
    for key, value in command.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = cli.train(argv)
    assert status == 0, f"{command.where}: {command.text}\n{' '.join(argv)}\n{err.getvalue()}"
    assert not (tmp_path / "run").exists()


def test_the_quick_tour_runs_as_written_under_torchrun(tmp_path):
    """README's quick tour, its Python block as it stands, on 4 ranks started by torchrun (a
    user's first script): every rank ends, and the logits it printed are the same everywhere."""
    from parallelkit.testing import free_port

    readme = (ROOT / "README.md").read_text()
    tour = readme[readme.index("## Quick tour") :]
    start = tour.index("```python\n") + len("```python\n")
    code = tour[start : tour.index("\n```", start)]
    script = tmp_path / "tour.py"
    shown = "print('logits', comm.rank, logits.sum().item(), dense.fc.out_features)"
    script.write_text(f"{code}\n{shown}\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), str(script)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PARALLELKIT_TIMEOUT="120")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("logits ")]
    assert sorted(int(w[1]) for w in lines) == [0, 1, 2, 3], proc.stdout
    assert len({w[2] for w in lines}) == 1 and {w[3] for w in lines} == {"1000"}, lines
