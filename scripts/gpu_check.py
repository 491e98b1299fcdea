"""The checks behind scripts/gpu_check.sh, the one command to run first on a GPU host.

    python scripts/gpu_check.py --gpus N [--out out/gpu_check] [--steps 10] [--budget-s 500]
        [--peak-tflops X] [--nvcc nvcc]

Runs in the interpreter it is started with (gpu_check.sh picks one that imports CUDA torch and
cupy; it never makes a venv or calls pip). Rows, each PASS, FAIL, SKIP, WARN or UNVERIFIED:
every N: the GPU path imports (other modules too; a missing optional dependency, e.g.
paramiko, tensorboard or tokenizers, is a SKIP naming it); int8.cu compiles to PTX with nvcc
under cupy's own flags (-ftz=true) and holds no flushing arithmetic; dist_runner.py has the GPU
flags. N >= 1 adds: torch and cupy see the GPUs; the kernel's bytes against the CPU codec,
compiled through cupy (denormals included); its bandwidth as a share of the device's measured
copy bandwidth (CUDA events around the launches alone; WARN, not FAIL, below 70%); the NCCL
stream ordering on one GPU (torch.cuda._sleep before an all-gather on a one-rank
communicator); every `-m gpu` test; GPU against CPU losses for a 2-stage pipeline, DiLoCo int8
with --overlap and fragments, --pipeline-compression int8, bf16/fp16, --compile and a resume on
CUDA. The `multi-gpu: ...` rows (scripts/gpu_multi.py: NCCL across ranks) need 2 GPUs: with
one they SKIP saying so, never PASS. On a GPU host, a GPU row that cannot run is a FAIL naming
why, and any SKIP other than a missing optional dependency fails the verdict.
OUT/results.json ({"rows": [{"name", "status", "detail", "reason" (the same), "seconds"}],
"verdict"}) and OUT/logs.tar are rewritten after every row, so a run that is cut off still
leaves what it measured; OUT/summary.md at the end. Exit 1 when the verdict is FAILED.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not __package__:
    # a GPU host runs this from a checkout, offline and without installing it (no pip): the
    # checkout on the path, here and for the scripts it starts (launch_local.py, gpu_multi.py)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT),
                                                           os.environ.get("PYTHONPATH")) if p)

from formats.errors import run_main  # noqa: E402
from formats.models import get_model  # noqa: E402
from formats.plan import Plan, SyncConfig, save_plan  # noqa: E402
from modules.comm.errors import first_line  # noqa: E402
from modules.data.dataset import DEFAULT_CORPUS  # noqa: E402
from modules.device.mfu import check_peak_tflops, flops_per_token, mfu  # noqa: E402
from modules.train.metrics import read_metrics, replica_metrics_path  # noqa: E402
from scripts import gpu_multi  # noqa: E402

PACKAGES = ("formats", "scheduler", "modules", "testkit", "scripts", "udp_hole_punching_test")
GPU_PATH = ("modules.comm.nccl", "modules.comm.watchdog", "modules.quant.cuda",
            "modules.quant.codec", "modules.quant.rows", "modules.quant.kernel_model",
            "modules.pipeline.stage", "modules.sync.overlap", "modules.train.trainer",
            "scripts.gpu_rows", "dist_runner")
"""What a GPU run needs: these must import (the rest may lack an optional dependency)."""
OPTIONAL = {"paramiko": "SSH launchers (scripts/cluster_ssh.py)",
            "tensorboard": "--tracker tensorboard", "tokenizers": "--tokenizer, BPE training",
            "wandb": "--tracker wandb", "netfilterqueue": "the NAT emulator"}
"""Optional dependencies: missing -> a SKIP row naming it, never a failure."""
GPU_FLAGS = ("--device", "--cuda-device", "--comm", "--precision", "--compile", "--peak-tflops",
             "--pipeline-compression", "--overlap", "--fragments", "--resume")
CUPY_FLAGS = ("-ftz=true",)
"""What cupy.RawModule adds to our options (cupy/cuda/compiler.py): the PTX is checked under it."""
MODEL = "gpt-tiny"
SAME_LOSS_REL = 5e-3
"""Per-step relative loss difference allowed between devices (or eager vs compiled) in fp32:
both compute the same arithmetic in another order (~1e-7 per op, 1.1e-7 after 5 steps for
compiled vs eager on CPU); wrong data or a missing gradient sum moves the loss by 1e-2 or
more. Not measured on a GPU yet: the table prints the measured difference."""
BF16_FINAL_REL = 0.03
"""bf16's final loss against fp32's (the CPU test's bar)."""
STATUSES = ("PASS", "FAIL", "SKIP", "WARN", "UNVERIFIED")
MULTI_BUDGET_S = 300.0
"""Time added to the budget for the multi-GPU rows (2+ GPUs)."""


@dataclass
class Row:
    """One line of the summary table."""

    name: str
    status: str
    """PASS, FAIL, SKIP, WARN or UNVERIFIED (see `verdict`)."""
    detail: str
    seconds: float = 0.0
    expected: bool = False
    """A SKIP that is expected on a GPU host (a missing optional dependency)."""


class Checker:
    """Runs commands from the repo root with a log per step, collects the rows and rewrites
    OUT/results.json and OUT/logs.tar after each one."""

    def __init__(self, out_dir: Path, python: str, timeout_s: float, gpus: int = 0,
                 budget_s: float = 500.0) -> None:
        self.out, self.python, self.timeout_s, self.gpus = out_dir, python, timeout_s, gpus
        self.rows: list[Row] = []
        self.deadline = time.monotonic() + budget_s
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)

    def add(self, name: str, status: str, t0: float, detail: str,
            expected: bool = False) -> None:
        """Record a row, print it at once and write the results so far."""
        assert status in STATUSES, status
        self.rows.append(Row(name, status, detail, round(time.monotonic() - t0, 1), expected))
        print(f"gpu_check: {status} {name}: {detail}", flush=True)
        self.save()

    def left_s(self) -> float:
        """Seconds left of the run's time budget."""
        return self.deadline - time.monotonic()

    def run(self, name: str, cmd: list[str], timeout_s: float | None = None) -> tuple[int, str]:
        """(exit status, output) of `cmd`, logged to OUT/logs/name.log; 124 when it timed out
        (its own limit, or what is left of the budget)."""
        limit = max(1.0, min(timeout_s or self.timeout_s, self.left_s()))
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
            code, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            code = 124
            out = f"{_text(e.stdout)}{_text(e.stderr)}\ngpu_check: timed out after {limit:g} s"
        except OSError as e:
            code, out = 127, f"gpu_check: cannot run {cmd[0]}: {e}"
        (self.out / "logs" / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{out}")
        return code, out

    def verdict(self) -> str:
        """FAILED on a FAIL, or on a GPU host on a SKIP that is not expected; else passed."""
        unexpected = self.gpus > 0 and any(r.status == "SKIP" and not r.expected
                                           for r in self.rows)
        return "FAILED" if self.failed() or unexpected else "passed"

    def failed(self) -> bool:
        """Whether any row is a FAIL."""
        return any(r.status == "FAIL" for r in self.rows)

    def save(self) -> None:
        """results.json and logs.tar as they stand (temp file + rename each)."""
        data = {"gpus": self.gpus, "python": self.python, "verdict": self.verdict(),
                "rows": [{**asdict(r), "reason": r.detail} for r in self.rows]}
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.out / "results.json")
        with tarfile.open(self.out / "logs.tar.tmp", "w") as tar:
            tar.add(self.out / "logs", arcname="logs")
        (self.out / "logs.tar.tmp").replace(self.out / "logs.tar")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _tail(out: str) -> str:
    """For a FAIL's detail: the first `error:` line of the output, else its last line."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln or "Error:" in ln]
    return (errors or lines or ["(no output)"])[0 if errors else -1][:200]


# -- checks that need no GPU ---------------------------------------------------------------
def module_names() -> list[str]:
    """Every module of the project's packages, and dist_runner."""
    names = []
    for pkg in PACKAGES:
        names.append(pkg)
        path = [str(ROOT / pkg)]
        names += [m.name for m in pkgutil.walk_packages(path, f"{pkg}.")]
    return names + ["dist_runner"]


def _import_all(names: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """(broken modules with their error, {missing dependency: modules that need it})."""
    broken, missing = [], {}
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            top = (e.name or "?").split(".")[0]
            if top in PACKAGES or top == "dist_runner":
                broken.append(f"{name}: {e}")
            else:
                missing.setdefault(top, []).append(name)
        except Exception as e:  # report every broken module, not just the first
            broken.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    return broken, missing


def check_imports(c: Checker) -> None:
    """The GPU path must import; every other module too, unless a dependency is missing (a
    SKIP row naming it: optional for a GPU run)."""
    t0 = time.monotonic()
    names = module_names()
    broken, missing = _import_all(list(GPU_PATH) + [n for n in names if n not in GPU_PATH])
    gpu_missing = {dep: mods for dep, mods in missing.items() if set(mods) & set(GPU_PATH)}
    if broken or gpu_missing:
        c.add("imports", "FAIL", t0, "; ".join(broken + [f"{', '.join(m)} need {d} (not "
                                                         f"installed)" for d, m in
                                                         gpu_missing.items()]))
    else:
        c.add("imports", "PASS", t0, f"the GPU path ({len(GPU_PATH)} modules) and "
              f"{len(names) - sum(map(len, missing.values()))} of {len(names)} modules import")
    for dep in sorted(set(OPTIONAL) | set(missing)):
        if dep in gpu_missing:
            continue
        if dep in missing or importlib.util.find_spec(dep) is None:
            mods = missing.get(dep, [])
            c.add(f"optional: {dep}", "SKIP", time.monotonic(), f"{dep} is not installed ("
                  f"{OPTIONAL.get(dep, 'not needed by the GPU path')}); not imported: "
                  f"{', '.join(mods) or 'none'}", expected=True)


def check_nvcc(c: Checker, nvcc: str) -> None:
    """Compile modules/quant/int8.cu to PTX for sm_80 and sm_90 with cupy's flags; both
    kernels present and no flushing (.ftz) arithmetic."""
    from modules.quant.cuda import COMPILE_OPTIONS, KERNEL_SOURCE

    t0, name = time.monotonic(), "kernel PTX under cupy's flags (nvcc)"
    exe = shutil.which(nvcc)
    if exe is None:
        c.add(name, "SKIP", t0, f"{nvcc!r} not found: the CUDA toolkit is not installed, the "
              "kernel was not compiled here (on a GPU host cupy compiles it with NVRTC at run "
              "time, checked by the kernel row)", expected=True)
        return
    for arch in ("sm_80", "sm_90"):
        ptx = c.out / f"int8_{arch}.ptx"
        code, out = c.run(f"nvcc_{arch}", [exe, "-ptx", *COMPILE_OPTIONS, *CUPY_FLAGS,
                                           f"-arch={arch}", "-o", str(ptx),
                                           str(KERNEL_SOURCE)], 300)
        text = ptx.read_text() if code == 0 and ptx.exists() else ""
        missing = [k for k in ("quantize_blocks", "dequantize_blocks")
                   if f".entry {k}" not in text]
        flushing = [ln.strip() for ln in text.splitlines() if ".ftz" in ln]
        if code != 0 or missing or flushing:
            c.add(name, "FAIL", t0, f"{arch}: exit {code}, missing kernels {missing}, "
                  f"{len(flushing)} .ftz instructions {flushing[:2]}: {_tail(out)}")
            return
    found = re.search(r"release [\d.]+", c.run("nvcc_version", [exe, "--version"], 60)[1])
    version = f"nvcc {found.group(0)}" if found else "nvcc version unknown"
    c.add(name, "PASS", t0, f"int8.cu -> PTX for sm_80 and sm_90 with {' '.join(CUPY_FLAGS)}: "
          f"both kernels, no .ftz instruction ({version})")


def check_runtime_flags(c: Checker, strict: bool) -> bool:
    """Whether `dist_runner.py --help` lists every flag the GPU runs use."""
    t0 = time.monotonic()
    code, out = c.run("dist_runner_help", [c.python, "dist_runner.py", "--help"], 120)
    missing = [f for f in GPU_FLAGS if not re.search(rf"{re.escape(f)}(?![\w-])", out)]
    if code == 0 and not missing:
        c.add("runtime GPU flags", "PASS", t0, f"dist_runner.py has {' '.join(GPU_FLAGS)}")
        return True
    c.add("runtime GPU flags", "FAIL" if strict else "WARN", t0,
          f"dist_runner.py --help (exit {code}) lacks {' '.join(missing)}: the GPU runs of "
          "this check need them")
    return False


# -- GPU checks --------------------------------------------------------------------------------
def gpu_blocker(gpus: int) -> str:
    """Why the GPU rows cannot run in this interpreter ('' when they can)."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import ({e})"
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen == 0:
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device "
                f"though nvidia-smi lists {gpus}")
    if importlib.util.find_spec("cupy") is None:
        return f"needs {importlib.import_module('modules.comm.nccl').cupy_package()} here"
    return ""


def check_torch_sees(c: Checker, gpus: int) -> str:
    """torch sees the GPUs nvidia-smi listed and cupy imports; returns the blocker ('' if none)."""
    t0 = time.monotonic()
    why = gpu_blocker(gpus)
    if why:
        c.add("torch + cupy see the GPUs", "FAIL", t0, f"{why} ({c.python})")
        return why
    import cupy
    import torch

    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    c.add("torch + cupy see the GPUs", "PASS", t0, f"torch {torch.__version__} (CUDA "
          f"{torch.version.cuda}) sees {torch.cuda.device_count()} of {gpus}: {names}; cupy "
          f"{cupy.__version__} ({c.python})")
    return ""


MULTI_GPU_SKIP = re.compile(r"2\+ CUDA devices|2 GPUs")
"""A -m gpu test's skip reason that is expected on a one-GPU host."""
CORPUS_SKIP = re.compile(r"fortunes not installed")
"""A -m gpu test's skip reason when the text corpus is missing (an optional dependency)."""


def gpu_test_files() -> list[str]:
    """The test modules holding a gpu-marked test: the others' module-level skips (no `ip`, no
    sshd, no hivemind on the GPU image) say nothing about the GPU path."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def check_gpu_tests(c: Checker) -> None:
    """Every test marked gpu: exit 0, at least one test run; a skip other than a multi-GPU
    test's on one GPU or a missing corpus's is a SKIP row (which fails the verdict on a GPU
    host)."""
    t0 = time.monotonic()
    code, out = c.run("pytest_gpu", [c.python, "-m", "pytest", "-m", "gpu", "-q", "-rs",
                                     "-p", "no:cacheprovider", *gpu_test_files()], 180)
    summary = next((ln for ln in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|"
                                                                        r"error)", ln)), "")
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    no_text = [ln for ln in skips if CORPUS_SKIP.search(ln)]
    unexpected = [ln for ln in skips if not MULTI_GPU_SKIP.search(ln) and ln not in no_text]
    if no_text:  # an offline GPU image has no apt: an optional dependency, named
        c.add("optional: text corpus", "SKIP", t0, f"{len(no_text)} -m gpu test line(s) need "
              f"real text ({DEFAULT_CORPUS}: apt-get install fortunes fortunes-min, or copy it "
              "there); the training rows below use --fake-data", expected=True)
    if code != 0 or "passed" not in summary:
        c.add("pytest -m gpu", "FAIL", t0, summary.strip("= ") or f"exit {code}: {_tail(out)}")
    elif unexpected:
        c.add("pytest -m gpu", "SKIP", t0, f"{summary.strip('= ')}; unexpected: "
              + "; ".join(ln[:160] for ln in unexpected[:3]))
    else:
        multi = len(skips) - len(no_text)
        note = f" ({multi} skip line(s) of multi-GPU tests: UNVERIFIED)" if multi else ""
        c.add("pytest -m gpu", "PASS", t0, summary.strip("= ") + note)


def in_process_row(c: Checker, name: str, fn: Callable[[], tuple[str, str]]) -> None:
    """A row computed in this process (scripts/gpu_rows.py); an exception is its FAIL."""
    t0 = time.monotonic()
    try:
        status, detail = fn()
    except Exception as e:
        status, detail = "FAIL", f"{type(e).__name__}: {first_line(e)[:240]}"
    c.add(name, status, t0, detail)


@dataclass
class Run:
    """What a training run left: losses per replica and its median tokens/s."""

    losses: dict[int, list[float]]
    tokens_per_s: float


class Trainer:
    """Writes plans and runs dist_runner.py through launch_local.py or torchrun."""

    def __init__(self, c: Checker, steps: int, peak_tflops: float | None,
                 model: str = MODEL) -> None:
        self.c, self.steps, self.peak, self.model = c, steps, peak_tflops, model
        self.data = [] if DEFAULT_CORPUS.exists() else ["--fake-data"]

    def plan(self, name: str, stages: list[tuple[int, int]], pipelines: list[list[int]],
             micro_batch_size: int, micro_batches: int, sync: SyncConfig) -> Path:
        """A plan/1 file for the model (written under OUT)."""
        path = self.c.out / f"{name}.json"
        save_plan(Plan("gpu-check", "", self.model, stages, pipelines, micro_batch_size,
                       micro_batches, sync), path)
        return path

    def train(self, name: str, plan: Path, flags: list[str], torchrun: int = 0,
              timeout_s: float | None = None) -> Run | str:
        """Train `plan` with dist_runner `flags`; a Run, or the reason it failed."""
        metrics = self.c.out / name / "m.jsonl"
        shutil.rmtree(metrics.parent, ignore_errors=True)
        args = ["--steps", str(self.steps), "--seed", "0", "--timeout-s", "120", "--log-every",
                "5", "--metrics", str(metrics), *self.data, *flags]
        if self.peak is not None and "cpu" not in flags:
            args += ["--peak-tflops", str(self.peak)]
        if torchrun:
            cmd = [self.c.python, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={torchrun}", "dist_runner.py", "--plan", str(plan), *args]
        else:
            cmd = [self.c.python, "scripts/launch_local.py", "--plan", str(plan), "--", *args]
        code, out = self.c.run(name, cmd, timeout_s)
        if code != 0:
            return f"{name}: exit {code}: {_tail(out)}"
        return read_run(metrics)


def read_run(metrics: Path) -> Run | str:
    """Losses of every replica's metrics file and replica 0's median tokens/s after 3 steps."""
    losses, rates, r = {}, [], 0
    while (path := replica_metrics_path(metrics, r)).exists():
        records = read_metrics(path)
        losses[r] = [rec["loss"] for rec in records]
        if r == 0:  # steps after the warm-up, or the last one of a short run
            rates = [rec["tokens_per_s"] for rec in (records[3:] or records[-1:])]
        r += 1
    if not losses or not all(losses.values()):
        return f"no metrics in {metrics}"
    return Run(losses, statistics.median(rates) if rates else float("nan"))


def max_rel_diff(got: Run, want: Run) -> float:
    """The largest per-step relative loss difference over every replica (inf on a mismatch)."""
    if got.losses.keys() != want.losses.keys():
        return float("inf")
    worst = 0.0
    for r, want_r in want.losses.items():
        if len(got.losses[r]) != len(want_r):
            return float("inf")
        worst = max([worst] + [abs(a - b) / abs(b) for a, b in zip(got.losses[r], want_r)])
    return worst


def compare(c: Checker, check: str, t0: float, got: Run | str, want: Run | str,
            rel: float) -> None:
    """PASS when every step's loss is within `rel` of the reference run's."""
    if isinstance(got, str) or isinstance(want, str):
        c.add(check, "FAIL", t0, got if isinstance(got, str) else want)
        return
    diff = max_rel_diff(got, want)
    steps = len(want.losses[0])
    c.add(check, "PASS" if diff <= rel else "FAIL", t0,
          f"max relative loss difference {diff:.2e} over {steps} steps x "
          f"{len(want.losses)} replica(s) (bar {rel:g}); final loss {got.losses[0][-1]:.4f}")


# -- training runs ---------------------------------------------------------------------------
CPU = ["--device", "cpu", "--comm", "gloo"]
GPU0 = ["--device", "cuda", "--cuda-device", "0"]


def speed(run: Run | str, trainer: Trainer) -> str:
    """`N tok/s` (and the MFU with --peak-tflops) of a single-replica run."""
    if isinstance(run, str):
        return "-"
    util = mfu(run.tokens_per_s, flops_per_token(get_model(trainer.model)), trainer.peak)
    return f"{run.tokens_per_s:.0f} tok/s" + (f" (MFU {100 * util:.1f}%)" if util else "")


def final_loss_row(c: Checker, check: str, t0: float, got: Run | str, want: Run | str) -> None:
    """PASS when the final loss is within BF16_FINAL_REL of the fp32 run's."""
    if isinstance(got, str) or isinstance(want, str):
        c.add(check, "FAIL", t0, got if isinstance(got, str) else want)
        return
    a, b = got.losses[0][-1], want.losses[0][-1]
    ok = abs(a - b) <= BF16_FINAL_REL * abs(b)
    c.add(check, "PASS" if ok else "FAIL", t0, f"final loss {a:.4f} vs fp32 {b:.4f} "
          f"({100 * (a - b) / b:+.2f}%, bar {100 * BF16_FINAL_REL:g}%)")


def check_one_gpu_runs(c: Checker, t: Trainer) -> Run | str:
    """gloo with both ranks on GPU 0 against the same plan on CPU: a 2-stage pipeline (fp32
    and int8 messages) and DiLoCo int8 with --overlap and 2 fragments. Returns the CPU
    pipeline run (the NCCL pipeline's reference)."""
    pp = t.plan("pp", [(0, 2), (2, 4)], [[0, 1]], 4, 2, SyncConfig())
    t0 = time.monotonic()
    pp_cpu = t.train("pp_cpu", pp, CPU)
    compare(c, "2-stage pipeline, 2 ranks on GPU 0, gloo, vs CPU", t0,
            t.train("pp_gpu_gloo", pp, GPU0 + ["--comm", "gloo"]), pp_cpu, SAME_LOSS_REL)
    t0, int8 = time.monotonic(), ["--pipeline-compression", "int8"]
    compare(c, "--pipeline-compression int8, 2 ranks on GPU 0, vs CPU", t0,
            t.train("pp_int8_gpu", pp, GPU0 + ["--comm", "gloo"] + int8),
            t.train("pp_int8_cpu", pp, CPU + int8), SAME_LOSS_REL)
    diloco = t.plan("diloco", [(0, 4)], [[0], [1]], 4, 2,
                    SyncConfig("diloco", inner_steps=5, compression="int8"))
    flags, t0 = ["--overlap", "on", "--fragments", "2"], time.monotonic()
    compare(c, "1x2 DiLoCo H=5 int8 --overlap --fragments 2, GPU 0 vs CPU", t0,
            t.train("diloco_gpu", diloco, GPU0 + ["--comm", "gloo"] + flags),
            t.train("diloco_cpu", diloco, CPU + flags), SAME_LOSS_REL)
    return pp_cpu


def check_precision_and_compile(c: Checker, t: Trainer) -> Run | str:
    """bf16 and fp16 against fp32 (final loss), --compile against eager (every step); returns
    the fp32 run."""
    single = t.plan("single", [(0, 4)], [[0]], 8, 1, SyncConfig())
    t0 = time.monotonic()
    fp32 = t.train("single_fp32", single, GPU0 + ["--precision", "fp32"])
    for name in ("bf16", "fp16"):
        run = t.train(f"single_{name}", single, GPU0 + ["--precision", name])
        final_loss_row(c, f"{name} vs fp32 on GPU 0", t0, run, fp32)
        c.rows[-1].detail += f"; {speed(run, t)} vs {speed(fp32, t)}"
        t0 = time.monotonic()
    compiled = t.train("single_compile", single, GPU0 + ["--compile"], timeout_s=240)
    compare(c, "--compile vs eager on GPU 0", t0, compiled, fp32, SAME_LOSS_REL)
    c.rows[-1].detail += f"; {speed(compiled, t)} vs {speed(fp32, t)}"
    return fp32


def check_resume(c: Checker, t: Trainer, whole: Run | str) -> None:
    """Train half the steps with a checkpoint on CUDA, resume to the end: the resumed steps'
    losses against the uninterrupted run's same steps."""
    t0, half = time.monotonic(), t.steps // 2
    ckpt = c.out / "resume_ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    single = c.out / "single.json"
    flags = GPU0 + ["--precision", "fp32", "--ckpt-dir", str(ckpt)]
    first = t.train("resume_first", single, flags + ["--steps", str(half)])
    second = t.train("resume_second", single, flags + ["--resume"]) \
        if not isinstance(first, str) else first
    if isinstance(whole, Run) and isinstance(second, Run):
        whole = Run({r: v[half:] for r, v in whole.losses.items()}, whole.tokens_per_s)
    compare(c, f"resume on CUDA at step {half} vs an uninterrupted run", t0, second, whole,
            SAME_LOSS_REL)


GPU_ROWS = ("kernel bytes = CPU codec (through cupy, denormals)",
            "kernel bandwidth vs device copy", "NCCL stream ordering on one GPU",
            "pytest -m gpu", "training runs on the GPU vs CPU")


def gpu_checks(c: Checker, args: argparse.Namespace, flags_ok: bool) -> None:
    """Everything that needs a GPU, in order; each row that cannot run FAILs by name."""
    why = check_torch_sees(c, args.gpus)
    if why:
        for name in GPU_ROWS:
            c.add(name, "FAIL", time.monotonic(), f"not run: {why}")
        gpu_multi.fail_all(c, why)
        return
    from scripts import gpu_rows

    in_process_row(c, GPU_ROWS[0], gpu_rows.kernel_identity)
    in_process_row(c, GPU_ROWS[1], gpu_rows.kernel_bandwidth)
    in_process_row(c, GPU_ROWS[2], gpu_rows.stream_ordering)
    check_gpu_tests(c)
    if not flags_ok:
        c.add(GPU_ROWS[4], "FAIL", time.monotonic(), "dist_runner.py lacks the GPU flags")
        gpu_multi.fail_all(c, "dist_runner.py lacks the GPU flags")
        return
    t = Trainer(c, args.steps, args.peak_tflops)
    pp_cpu = check_one_gpu_runs(c, t)
    check_resume(c, t, check_precision_and_compile(c, t))
    c.deadline += MULTI_BUDGET_S if args.gpus > 1 else 0  # NCCL's own runs (gpu_multi.py)
    gpu_multi.multi_gpu_checks(c, t, args.gpus, pp_cpu)


def summary(c: Checker, gpus: int, wall_s: float) -> str:
    """The markdown table of every row, with the verdict and the wall time."""
    lines = ["| check | result | s | detail |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.detail} |" for r in c.rows]
    where = f"{gpus} GPU(s)" if gpus else "no GPU (imports and kernel compilation only)"
    counts = ", ".join(f"{sum(r.status == s for r in c.rows)} {s}" for s in STATUSES)
    lines.append(f"\ngpu_check {c.verdict()} on {where} in {wall_s:.0f} s ({counts})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = argparse.ArgumentParser(description="GPU check: imports, kernel compilation and, on a "
                                "GPU host, the kernel, stream ordering, GPU tests and GPU "
                                "training runs against CPU; one verdict.")
    p.add_argument("--gpus", type=int, required=True,
                   help="GPUs nvidia-smi lists (0: the no-GPU checks only)")
    p.add_argument("--out", "--out-dir", dest="out", default=str(ROOT / "out" / "gpu_check"),
                   help="results.json, logs.tar, summary.md, plans and metrics")
    p.add_argument("--steps", type=int, default=10, help="steps of each training run")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="the whole run's time limit: commands are cut at what is left")
    p.add_argument("--peak-tflops", type=float,
                   help="the GPU's peak TFLOP/s, passed to the GPU runs and used for the MFU "
                   "in the table (one value for every run: fp32 and bf16 peaks differ)")
    p.add_argument("--nvcc", default="nvcc", help="nvcc to compile the kernel with")
    args = p.parse_args(argv)
    check_peak_tflops(args.peak_tflops)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the checks for --gpus, print and write the summary; 1 if the verdict is FAILED."""
    args = parse_args(argv)
    start = time.monotonic()
    c = Checker(Path(args.out), sys.executable, 300, args.gpus, args.budget_s)
    check_imports(c)
    check_nvcc(c, args.nvcc)
    flags_ok = check_runtime_flags(c, strict=args.gpus > 0)
    if args.gpus > 0:
        gpu_checks(c, args, flags_ok)
    text = summary(c, args.gpus, time.monotonic() - start)
    print(f"\n{text}")
    (c.out / "summary.md").write_text(text + "\n")
    c.save()
    return 1 if c.verdict() == "FAILED" else 0


def entry() -> None:
    """Run main() under run_main (user errors exit 2)."""
    run_main(main)


if __name__ == "__main__":
    entry()
