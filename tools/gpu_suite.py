"""Every GPU-marked test, sharded over the GPUs of one machine: one pytest process per GPU (CUDA_VISIBLE_DEVICES),
all under one time limit. On one H200 with a warm kernel cache the fast tier (`--fast`, 252 tests) took 205 s and the
slow one (`--marker "gpu and slow"`, 1,513 tests) 482 s; they can run apart.
Several processes on one GPU stall each other: the decode kernels that spin on cluster or global exchanges,
time-sliced against another context, ran for minutes.

The collected tests (the end-to-end files first) are dealt round-robin, so each shard gets a share of the slow
ones, and each log ends with its 15 slowest tests. Each process runs under `timeout -s INT`, so a shard stopped by
the limit still prints pytest's summary, and `-v` names every test as it finishes: the table counts what passed,
failed, was skipped or errored and what the limit left unreached, whose ids go to --left. `--only FILE` runs just the ids listed there (a later call resumes with the file --left wrote).
Logs go to --log-dir. Exit status 1 if a test failed or errored, 2 if some were not reached, else 0."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
# the slow end-to-end files first: what the limit leaves unreached is then the kernel files' short cases; every other
# test file after them (all_files), so that a GPU test in a new file is never left out
FIRST = ("tests/test_gpu_e2e.py", "tests/test_cuda_moe.py", "tests/test_hardening.py", "tests/test_gpu_formats.py",
         "tests/test_gpu_speculative.py", "tests/test_gpu_paged.py", "tests/test_gpu_plan.py", "tests/test_cuda_rows.py",
         "tests/test_serve_gpu.py", "tests/test_serve_speculative.py", "tests/test_cuda_allreduce.py",
         "tests/test_gpu_parallel.py", "tests/test_cuda_gemv.py", "tests/test_cuda_gemm.py",
         "tests/test_cuda_attention.py", "tests/test_cuda_ffn_decode.py", "tests/test_cuda_norm.py",
         "tests/test_cuda_lm_head_sampling.py", "tests/test_cuda_runtime.py")


def all_files() -> list[str]:
    """FIRST, then every other tests/test_*.py (collect() keeps only the tests the marker selects)."""
    rest = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    return list(FIRST) + [f for f in rest if f not in FIRST]


# pytest -v's line for a finished test: its id, then the outcome (setup errors are reported as ERROR)
OUTCOME = re.compile(r"^(\S+::.+?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
COUNTED = ("PASSED", "FAILED", "SKIPPED", "ERROR")  # the table's outcome columns


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 where it is missing or fails)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def collect(files, marker: str) -> list[str]:
    """The test ids pytest collects from files under the marker expression, in order."""
    r = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-m", marker, "-p", "no:cacheprovider", *files],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 5):  # 5: nothing collected
        raise click.ClickException(f"collection failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return [line.strip() for line in r.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def outcomes(log: str) -> dict[str, str]:
    """test id -> its outcome, from a pytest -v log (the last outcome a test reported: a teardown error after
    PASSED counts as ERROR)."""
    got = {}
    for line in log.splitlines():
        m = OUTCOME.match(line)
        if m:
            tid, res = m.groups()
            got[tid] = res if got.get(tid) in (None, "PASSED", "SKIPPED") else got[tid]
    return got


@click.command()
@click.argument("files", nargs=-1)
@click.option("--gpus", type=int, default=0, help="shards, one per GPU (default: every GPU nvidia-smi lists)")
@click.option("--limit", type=int, default=540, help="seconds each shard may run")
@click.option("--marker", default="gpu", help="pytest -m expression selecting the tests")
@click.option("--fast", is_flag=True, help='the fast tier only: -m "gpu and not slow" (tests/conftest.py)')
@click.option("--only", "only", type=click.Path(exists=True, dir_okay=False), default=None,
              help="run only the test ids listed in this file (one per line), e.g. an earlier run's --left")
@click.option("--left", default=None, help="write the ids no shard reached here (default LOG_DIR/left.txt)")
@click.option("--log-dir", default=os.environ.get("OUT", "gpu_suite_logs"), help="per-shard logs (default $OUT)")
def main(files, gpus, limit, marker, fast, only, left, log_dir):
    files = files or all_files()
    marker = "gpu and not slow" if fast else marker
    n = gpus or gpu_count()
    if n < 1:
        raise click.ClickException("no GPU found (nvidia-smi -L); --gpus N sets the shard count")
    ids = collect(files, marker)
    if only:
        wanted = {line.strip() for line in Path(only).read_text().splitlines() if line.strip()}
        ids = [t for t in ids if t in wanted]
    if not ids:
        raise click.ClickException("no tests selected")
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    shards = [ids[i::n] for i in range(n)]
    print(f"{len(ids)} tests in {n} shards, {limit} s each", file=sys.stderr, flush=True)
    procs, t0 = [], time.time()
    for i, sh in enumerate(shards):
        if not sh:
            continue
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        # the CPU references' BLAS threads shared out: n processes of every-core threads oversubscribe the host
        # (4 shards on 64 cores finished 33 tests in 520 s, each process's interrupt inside the NumPy reference)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(max(1, (os.cpu_count() or 1) // n)))
        log = open(logs / f"shard{i}.log", "w")
        # SIGINT first, so pytest reports what it has; SIGKILL 30 s later if it does not stop
        cmd = ["timeout", "-s", "INT", "-k", "30", str(limit), sys.executable, "-m", "pytest", "-v", "-rfEs",
               "-p", "no:cacheprovider", "--tb=short", "--durations=15", *sh]
        procs.append((i, sh, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    rows, unreached, bad = [], [], 0
    for i, sh, p, log in procs:
        p.wait()
        log.close()
        got = outcomes((logs / f"shard{i}.log").read_text(errors="replace"))
        miss = [t for t in sh if t not in got]
        unreached += miss
        counts = {k: sum(1 for t in sh if got.get(t) == k) for k in COUNTED}
        bad += counts["FAILED"] + counts["ERROR"]
        rows.append((i, len(sh), counts, len(miss), p.returncode, time.time() - t0))
    left_path = Path(left) if left else logs / "left.txt"
    left_path.write_text("".join(t + "\n" for t in unreached))
    print("| shard (GPU) | tests | passed | failed | skipped | errors | not reached | pytest exit | s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, n_t, c, miss, rc, s in rows:
        print(f"| {i} | {n_t} | {c['PASSED']} | {c['FAILED']} | {c['SKIPPED']} | {c['ERROR']} | {miss} | {rc} | {s:.0f} |")
    tot = {k: sum(r[2][k] for r in rows) for k in COUNTED}
    print(f"| all | {len(ids)} | {tot['PASSED']} | {tot['FAILED']} | {tot['SKIPPED']} | {tot['ERROR']} | {len(unreached)} | | |")
    if unreached:
        print(f"{len(unreached)} not reached: {left_path} (--only {left_path} resumes them)", file=sys.stderr)
    sys.exit(1 if bad else 2 if unreached else 0)


if __name__ == "__main__":
    main()
