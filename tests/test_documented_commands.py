"""Commands the README and docs/models.md show, run as written (a maintained list: each is
first found verbatim in its page, so a page that changes a command changes this list too),
with the first lines of their quoted output checked against what the code prints now."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("scheduler", "scripts", "formats", "modules", "testkit", "dist_runner.py")

TOUR = [  # README's tour, steps 1, 4 and 5: (command, extra test flags, output to find)
    ("python scheduler/scheduler.py scenario worldwide --seed 0 --out worldwide.json", (),
     "wrote worldwide.json: worldwide-seed0, 64 devices in 8 regions, full form (cluster/1)"),
    ("python scheduler/scheduler.py plan --cluster worldwide.json --model gpt3-xl --stages 8 "
     "--replicas 8 --objective dtfm --out plan.json --plot plan.png", (),
     "plan gpt3-xl on worldwide-seed0: 8 stages x 8 replicas, objective dtfm"),
    ("python scheduler/scheduler.py scenario lab --seed 0 --out lab.json", (),
     "wrote lab.json: lab-seed0, 8 devices in 4 regions, full form (cluster/1)"),
    ("python scheduler/scheduler.py plan --cluster lab.json --model gpt-tiny --micro-batch-size 4 "
     "--micro-batches 2 --runtime cpu --time-limit 20 --out lab-plan.json --quiet", (),
     "plan gpt-tiny on lab-seed0: 2 stages x 4 replicas, objective simulated"),
    ("python scripts/launch_local.py --plan lab-plan.json -- --steps 10 --fake-data --run-dir run "
     "--log-every 5", ("--threads", "1"), "[rank 6] step 10/10 loss"),
    ("python scripts/plot_run.py run", (), "wrote run/run.png"),
    ("python scheduler/scheduler.py explain --plan lab-plan.json --metrics run --cluster lab.json",
     (), "measured / predicted seconds per step (mean over steps: the first step left out)"),
]
MODELS = [  # docs/models.md: a config written with transformers, planned (a shorter search)
    ("python -c \"import transformers as t; t.LlamaConfig(hidden_size=1024, "
     "intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16, "
     "max_position_embeddings=1024, vocab_size=32000).save_pretrained('my-llama')\"", (), ""),
    ("python scheduler/scheduler.py plan --scenario regional --model my-llama --stages 4 "
     "--replicas 16 --out plan.json", ("--time-limit", "5", "--quiet"), "wrote plan.json"),
]


def _commands(page: Path) -> str:
    """The page's code blocks, each command on one line (continuations joined, `$ ` dropped)."""
    text = re.sub(r"\\\n\s*", "", page.read_text(encoding="utf-8"))
    return "\n".join(line.removeprefix("$ ") for line in text.splitlines())


def _run_all(tmp_path: Path, page: Path, commands) -> str:
    """Run each command in a scratch folder; the last one's output."""
    shown = _commands(page)
    for name in LINKED:  # the commands' relative paths, outputs kept out of the checkout
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command, extra, expect in commands:
        assert command in shown, f"{page.name} no longer shows: {command}"
        line = f"{command} {' '.join(extra)}"  # after `--`: to every rank
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, f"{line}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        assert expect in r.stdout, f"{line}: {expect!r} not in\n{r.stdout[-2000:]}"
    return r.stdout


@pytest.mark.timeout(400)
def test_readme_tour_runs_as_written(tmp_path):
    report = _run_all(tmp_path, ROOT / "README.md", TOUR).splitlines()
    quoted = (ROOT / "README.md").read_text(encoding="utf-8")
    # the page quotes explain's report as explain prints it: its header and row layout
    assert report[0] in quoted and report[1] in quoted
    assert any(line.startswith("biggest difference: ") for line in report)


@pytest.mark.timeout(300)
def test_models_page_commands_run_as_written(tmp_path):
    pytest.importorskip("transformers", reason="pip install -e .[dev] installs it")
    _run_all(tmp_path, ROOT / "docs" / "models.md", MODELS)
