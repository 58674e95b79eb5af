"""The predict and start-up probe families of tests/scripts/fault_probes.py (a mixin its
``Probes`` class inherits; run them with ``--family predict_outputs startup``).

    predict_outputs  ``parallelkit predict`` owns its output folder: never written over an
                     input, one prediction per sample, one predict per folder, resume, NIfTI
                     float16, write errors in one line, no code named by a run's config
    startup          the start-up of ``parallelkit train``: OpenMP threads, a data set's
                     threads, a rank stuck before its first collective, the launcher killed
                     while its ranks start, a check failing on rank 1, leftover torchrun
                     variables, srun without PMI
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import fault_probes as fp  # the helpers (fault_probes.py registers itself under this name)
import numpy as np
import yaml

SCRIPTS = Path(__file__).resolve().parent


def digest(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder``, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def together(commands: list[tuple[list[str], dict[str, str]]], cwd: Path, run_dir: Path,
             timeout: float) -> list[fp.Run]:  # fmt: skip
    """Each ``(args, env)`` as ``python -m parallelkit.cli ARGS`` with exactly ``env`` (plus
    this probe's token), all at once, as srun starts its tasks."""
    token = f"probe-{time.monotonic_ns()}"
    procs = []
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        for (args, env), out in zip(commands, outs, strict=True):
            procs.append(subprocess.Popen(
                [fp.PYTHON, "-m", "parallelkit.cli", *args], stdout=out,
                stderr=subprocess.STDOUT, env={**env, "PK_PROBE": token}, cwd=cwd,
                start_new_session=True))  # fmt: skip
        while any(p.poll() is None for p in procs) and time.monotonic() - start < timeout:
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        statuses = [p.wait() for p in procs]
        seconds = time.monotonic() - start
        fp.kill_leftovers(token)
        runs = []
        for status, out in zip(statuses, outs, strict=True):
            out.seek(0)
            output = out.read()
            started = bool(fp.STARTED.search(output)) or run_dir.exists()
            runs.append(fp.Run(status, seconds, output, started, time.monotonic()))
        return runs


class PredictProbes:
    """The ``predict_outputs`` and ``startup`` families (``self.dir`` and ``self.sink`` are
    ``fault_probes.Probes``'s)."""

    # predict: the output folder is the user's -------------------------------------------------
    def predict_outputs(self) -> list[fp.Result]:
        results = self.sink
        d = self.dir("predict-run")
        data = fp.blocks(d / "data", "npy")
        run_dir = d / "run"
        first = fp.train(run_dir, *fp.SEGMENT, f"data.name=npy:{data}", "parallel.ranks=2")
        if first.status != 0:
            results.append(fp.accepted("P", "predict: the run (tiny segment train)", first))
            return results

        def predict(*overrides: str, ranks: int = 2, timeout: float = 150,
                    **kw) -> fp.Run:  # fmt: skip
            return fp.run_cli(["predict", f"train.run_dir={run_dir}", f"parallel.ranks={ranks}",
                               *overrides], None, timeout, **kw)  # fmt: skip

        # 1. an output folder that is the input folder
        inputs = self.dir("predict-into-input") / "in"
        shutil.copytree(data / "test" / "images", inputs)
        before = digest(inputs)
        same = [f"predict.input={inputs}", f"predict.output={inputs}", "predict.overwrite=true"]
        run = predict(*same, "predict.format=npy")
        result = fp.refused("P1", "output = input folder, npy: refused", run, None,
                            message="would be written over the input")  # fmt: skip
        if digest(inputs) != before:
            result.verdict, result.note = False, "; ".join(
                filter(None, [result.note, "an input changed"]))  # fmt: skip
        results.append(result)
        run = predict(*same, "predict.format=zarr")
        after = {k: v for k, v in digest(inputs).items() if k in before}
        results.append(fp.accepted("P1", "output = input folder, zarr: written beside", run, {
            "an input changed": after == before,
            "no s0.zarr": (inputs / "s0.zarr").is_dir(),
        }))  # fmt: skip

        # 2. samples of one file name (a dataset.json layout), and two that cannot be told apart
        listed = self.dir("predict-one-name") / "listed"
        for folder, i in (("a", 0), ("b", 1)):
            (listed / folder).mkdir(parents=True)
            (listed / f"{folder}-labels").mkdir()
            np.save(listed / folder / "c.npy", np.full((1, 20, 20), i, np.float32))
            label = data / "test" / "masks" / f"s{i}.npy"
            shutil.copy(label, listed / f"{folder}-labels" / "c.npy")
        pairs = [{"image": f"./{f}/c.npy", "label": f"./{f}-labels/c.npy"} for f in "ab"]
        (listed / "dataset.json").write_text(json.dumps({"training": pairs[:1],
                                                         "validation": pairs}))  # fmt: skip
        out = listed.parent / "out"
        run = predict(f"data.name=npy:{listed}", f"predict.output={out}", "predict.format=npy")
        names = sorted(p.name for p in out.glob("*.npy")) if out.is_dir() else []
        results.append(fp.accepted("P2", "a/c.npy and b/c.npy (dataset.json): 2 outputs", run, {
            f"outputs {names}": names == ["a__c.npy", "b__c.npy"],
        }))  # fmt: skip
        twins = self.dir("predict-twins") / "twins"
        twins.mkdir()
        np.save(twins / "c.npy", np.ones((1, 20, 20), np.float32))
        fp.write(twins / "c", np.ones((1, 20, 20), np.float32), "zarr")
        run = predict(f"predict.input={twins}", f"predict.output={twins.parent / 'o'}")
        result = fp.refused("P2", "c.npy and c.zarr in one folder: refused", run, None,
                            message="would both be predicted into the name 'c'")  # fmt: skip
        line = fp.error_line(run.output)
        if not ("c.npy" in line and "c.zarr" in line):
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, "both files not named"]))
        results.append(result)

        # 3. two predicts into one folder at once
        held = self.dir("predict-held") / "out"
        first = predict(f"predict.output={held}", "predict.format=npy")  # its folder, then held
        (held / ".parallelkit-predict").mkdir(parents=True, exist_ok=True)
        holder = subprocess.Popen(  # the lock a running predict's rank 0 holds
            [fp.PYTHON, "-c", "import time; from parallelkit.train.store.rundir import Lock; "
             f"Lock({str(held / '.parallelkit-predict')!r}); print('held', flush=True); "
             "time.sleep(300)"], stdout=subprocess.PIPE, text=True, cwd=fp.ROOT,
            env=dict(os.environ, PYTHONPATH=str(fp.ROOT)))  # fmt: skip
        try:
            if holder.stdout.readline().strip() != "held":
                raise RuntimeError("the lock holder did not start")
            run = predict(f"predict.output={held}", "predict.format=npy")
        finally:
            holder.kill()
            holder.wait()
        result = fp.refused("P3", "a second predict into a held output", run, None,
                            message="in use by another parallelkit predict")  # fmt: skip
        if first.status != 0:
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, f"first exit {first.status}"]))
        results.append(result)

        # 4. resume: other settings redone, a foreign file in the way refused
        out = self.dir("predict-resume") / "out"
        plain = [f"predict.output={out}", "predict.format=npy"]
        first = predict(*plain)
        run = predict(*plain, "predict.resume=true", "predict.probabilities=true")
        probs = sorted(p.name for p in out.glob("*_probabilities.npy")) if out.is_dir() else []
        results.append(fp.accepted("P4", "resume with probabilities: both written", run, {
            f"first predict exit {first.status}": first.status == 0,
            f"probabilities {probs}": probs == ["s0_probabilities.npy", "s1_probabilities.npy"],
        }))  # fmt: skip
        foreign = out / "s1.npy"
        for p in (foreign, out / "s1_probabilities.npy"):
            p.unlink(missing_ok=True)
        foreign.write_text("x")
        run = predict(*plain, "predict.resume=true", "predict.probabilities=true")
        result = fp.refused("P4", "resume: a foreign file in the way", run, foreign,
                            message="is in the way")  # fmt: skip
        if foreign.read_text() != "x":
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, "the foreign file changed"]))
        results.append(result)

        # 5. NIfTI probabilities in the default float16
        import nibabel as nib

        out = self.dir("predict-nifti") / "out"
        run = predict(f"predict.output={out}", "predict.format=nifti", "predict.probabilities=true")
        stored = sorted(out.glob("s0_probabilities.nii*")) if out.is_dir() else []
        dtype = np.asarray(nib.load(stored[0]).dataobj).dtype if stored else None
        results.append(fp.accepted("P5", "NIfTI probabilities (float16) stored as float32", run, {
            "float32 not said": "float32" in run.output,
            f"stored as {dtype}": dtype == np.float32,
        }))  # fmt: skip

        # 6. write errors: a file size limit, a full disk, no room, a read-only folder
        def leftovers(folder: Path) -> list[str]:
            return sorted(p.name for p in folder.iterdir() if p.name != ".parallelkit-predict") \
                if folder.exists() else []  # fmt: skip

        write_args = ["predict.format=npy", "predict.probabilities=true", "predict.dtype=float32"]
        out = self.dir("predict-ulimit") / "out"
        # 4 KiB for predict, not for the probe's file of its output (cat writes that)
        limit = ["bash", "-c", 'set -o pipefail; (ulimit -f 4 && exec "$@") 2>&1 | cat', "sh"]
        run = predict(*write_args, f"predict.output={out}", wrap=limit)
        result = fp.refused("P6", "ulimit -f 4: File too large", run, None,
                            early=False, message="File too large")  # fmt: skip
        if result.verdict:
            result.note = "found while writing, after the ranks started"
        if left := leftovers(out):
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, f"left {left}"]))
        results.append(result)
        faults = str(SCRIPTS / "predict_output_faults.py")
        for mode, message in (("full", "No space left on device"), ("no-room", "MiB free"),
                              ("read-only", "not writable")):  # fmt: skip
            out = self.dir(f"predict-{mode}") / "out"
            if mode == "read-only":
                out.mkdir()
            run = fp.run_cli([f"train.run_dir={run_dir}", "parallel.ranks=1", *write_args,
                              f"predict.output={out}"], None, 150,
                             program=[faults, mode])  # fmt: skip
            result = fp.refused("P6", f"predict_output_faults.py {mode}", run, None,
                                early=mode != "full", message=message)  # fmt: skip
            if result.verdict and mode == "full":
                result.note = "found while writing, after the ranks started"
            if left := leftovers(out):
                result.verdict = False
                result.note = "; ".join(filter(None, [result.note, f"left {left}"]))
            results.append(result)

        # 7. a run's config that names other code
        d = self.dir("predict-config-code")
        copy = d / "run"
        shutil.copytree(run_dir, copy)
        made = d / "made-by-popen"
        config = yaml.safe_load((copy / "config.yaml").read_text())
        config["model"]["name"] = "subprocess:Popen"
        config["model"]["kwargs"] = {"args": ["touch", str(made)]}
        (copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        run = fp.run_cli(["predict", f"train.run_dir={copy}", "parallel.ranks=2",
                          f"predict.output={d / 'out'}"], None, 150)  # fmt: skip
        time.sleep(0.5)
        result = fp.refused("P7", "config.yaml names subprocess:Popen", run, None,
                            message="not other code")  # fmt: skip
        if made.exists():
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, f"{made} was created"]))
        results.append(result)
        return results

    # start-up: threads, hangs, a killed launcher, one rank's check, leftover variables --------
    def startup(self) -> list[fp.Result]:
        results = self.sink
        one_step = [*fp.TINY, "train.max_steps=1", "parallel.ranks=2"]
        user = os.pathsep.join([str(fp.ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")])
        with_user = ["env", f"PYTHONPATH={user}"]

        # 8. OpenMP threads in the launcher
        for threads in ("2", "4"):
            run_dir = self.dir(f"omp-{threads}") / "run"
            run = fp.train(run_dir, *one_step, wrap=["env", f"OMP_NUM_THREADS={threads}"])
            results.append(fp.accepted("S8", f"OMP_NUM_THREADS={threads}", run, {
                f"{run.seconds:.0f} s > 150 s": run.seconds <= 150,
                "header lacks 'local ranks started by parallelkit ('":
                    "local ranks started by parallelkit (" in run.output,
            }))  # fmt: skip

        # 9. a data set that starts threads on import
        run_dir = self.dir("threaded-dataset") / "run"
        run = fp.train(run_dir, *one_step, "data.name=threaded_dataset:Threaded", wrap=with_user)
        results.append(fp.accepted("S9", "data set with threads on import", run, {
            "header lacks '(processes, not forks: the launcher runs'":
                "(processes, not forks: the launcher runs" in run.output,
        }))  # fmt: skip

        # 10. a rank stuck in its start-up
        run_dir = self.dir("stuck-rank") / "run"
        run = fp.train(run_dir, *fp.TINY, "parallel.ranks=2", "data.name=startup_code:Hangs",
                       "parallel.timeout=5", wrap=with_user, timeout=120)  # fmt: skip
        results.append(fp.judged("S10", "a rank stuck in start-up (parallel.timeout=5)", run, {
            f"exit {run.status}, not 1": run.status == 1,
            f"{run.seconds:.0f} s > 90 s": run.seconds <= 90,
            "no 'before the first collective'": "before the first collective" in run.output,
        }))  # fmt: skip

        # 11. SIGKILL of the launcher while the ranks start
        for forked in (True, False):
            env = [] if forked else ["PARALLELKIT_FORK_RANKS=0"]

            def kill_launcher(proc: subprocess.Popen, token: str, forked: bool = forked) -> bool:
                if not all(fp.probe_pids(token, rank=r) for r in range(2)):
                    return False
                if forked:
                    time.sleep(3)  # in their checks, where the data set hangs
                os.kill(proc.pid, signal.SIGKILL)
                kill_launcher.killed = True
                at = time.monotonic()
                while time.monotonic() - at < 30:
                    alive = [p for p in fp.probe_pids(token) if p != proc.pid]
                    if not alive:
                        break
                    time.sleep(0.1)
                kill_launcher.gone = time.monotonic() - at
                kill_launcher.alive = alive
                return True

            kill_launcher.killed = False
            run_dir = self.dir(f"sigkill-launcher-forked-{forked}") / "run"
            run = fp.train(run_dir, *fp.TINY, "parallel.ranks=2", "data.name=startup_code:Hangs",
                           "parallel.timeout=300", wrap=[*with_user, *env], timeout=150,
                           while_running=kill_launcher)  # fmt: skip
            gone = getattr(kill_launcher, "gone", float("nan"))
            name = f"launcher SIGKILLed while ranks start (forked={forked})"
            results.append(fp.judged("S11", name, run, {
                "the ranks never appeared": kill_launcher.killed,
                f"ranks alive {gone:.1f} s after: {getattr(kill_launcher, 'alive', [])}":
                    kill_launcher.killed and gone <= 20,
            }))  # fmt: skip
            results[-1].note = results[-1].note or f"ranks gone {gone:.1f} s after the kill"

        # 12. a check failing on rank 1
        run_dir = self.dir("failing-rank-1") / "run"
        run = fp.train(run_dir, *one_step, "model.name=startup_code:failing", wrap=with_user)
        results.append(fp.judged("S12", "a check failing on rank 1", run, {
            f"exit {run.status}, not 2": run.status == 2,
            "no 'error on rank 1 (exit status 2):'": "error on rank 1 (exit status 2):"
            in run.output,
        }))  # fmt: skip

        # 13. leftover torchrun variables
        run_dir = self.dir("torchrun-leftovers") / "run"
        run = fp.train(run_dir, *one_step, wrap=["env", "WORLD_SIZE=2", "RANK=0",
                                                 "MASTER_PORT=29500"])  # fmt: skip
        result = fp.refused("S13", "WORLD_SIZE RANK MASTER_PORT left in the shell", run, None,
                            message="not LOCAL_RANK")  # fmt: skip
        if "unset" not in fp.error_line(run.output):
            result.verdict = False
            result.note = "; ".join(filter(None, [result.note, "no 'unset'"]))
        results.append(result)

        # 14. srun without PMI: two tasks, MPI sees each alone (with parallel.backend=gloo
        # they meet through SLURM's variables and train, as they should)
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("SLURM", "PMI", "OMPI", "PMIX")) and k not in
                ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}  # fmt: skip
        base.update(OMP_NUM_THREADS="1", PYTHONPATH=user, PYTHONWARNINGS="default")
        for check in (False, True):
            d = self.dir(f"srun-no-pmi-check-{check}")
            run_dir = d / "run"
            args = ["train", *(["--check"] if check else []), f"train.run_dir={run_dir}",
                    *fp.TINY[:-1], "train.max_steps=1"]  # the default backend: MPI here
            tasks = [(args, {**base, "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
                             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0",
                             "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
                             "SLURM_JOB_NODELIST": "localhost"}) for r in range(2)]  # fmt: skip
            for r, run in enumerate(together(tasks, d, run_dir, 150)):
                # task 1's line says "error on rank 1:", not "error:": judged by hand
                name = f"srun without PMI, task {r}{' (--check)' if check else ''}"
                want = "srun started 2 tasks but MPI sees 1"
                lines = [ln for ln in run.output.splitlines() if want in ln]
                results.append(fp.judged("S14", name, run, {
                    f"exit {run.status}, not 2": run.status == 2,
                    f"{len(lines)} lines with {want!r}, not 1": len(lines) == 1,
                    "'check passed' said": "check passed" not in run.output,
                    "after the ranks started": not run.started,
                }))  # fmt: skip
        return results
