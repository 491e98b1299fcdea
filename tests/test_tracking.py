"""--tracker jsonl|tensorboard|wandb write what they claim; --run-dir holds metrics, per-rank
timing and the plan; scripts/plot_run.py draws a real run folder."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys

import pytest

from formats.cluster import Cluster, Device, save_cluster
from formats.errors import UserError
from formats.plan import Plan, load_plan, save_plan
from formats.run_metrics import RANK_FIELDS, load_run, rank_timing_path
from modules.config import MetricsConfig, RunConfig
from modules.train.tracking import SCALARS, open_trackers
from tests.conftest import ROOT, run_entry

RECORDS = [{"step": k, "loss": 5.0 - 0.25 * k, "tokens": 256 * k, "tokens_per_s": 1000.0 + k,
            "bytes_sent": 4096 * k, "dp_bytes_sent": 0, "outer_step": None, "replica": 1,
            "comm": {"all": "gloo"}, **({"val_loss": 4.5} if k == 3 else {})}
           for k in (1, 2, 3)]


def log_all(cfg: MetricsConfig, replica: int = 1) -> None:
    trackers = open_trackers(cfg, replica, None, {"test": True})
    for rec in RECORDS:
        trackers.log(rec)
    trackers.close()


def test_jsonl_and_tensorboard_write_every_scalar(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install -e .[track])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_all(MetricsConfig(run_dir=str(tmp_path), tracker="jsonl,tensorboard"))
    lines = (tmp_path / "metrics.r1.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == RECORDS  # replica 1: metrics.r1.jsonl, every field
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "replica1"))
    acc.Reload()
    for key in ("loss", "tokens_per_s", "bytes_sent", "val_loss"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in RECORDS if key in r], key
        assert [e.value for e in events] == pytest.approx([r[key] for r in RECORDS if key in r])
    assert "outer_step" not in acc.Tags()["scalars"]  # None (allreduce) is not a number
    assert set(acc.Tags()["scalars"]) <= set(SCALARS)


def test_tracker_flag_checks():
    for bad in ("jsonl,mlflow", "", ",", "jsonl,,tensorboard", "jsonl,jsonl", "jsonl,"):
        with pytest.raises(UserError, match="--tracker: expected .* each once"):
            MetricsConfig(tracker=bad, run_dir="r")
    assert MetricsConfig(tracker=" jsonl , tensorboard", run_dir="r").trackers() == (
        "jsonl", "tensorboard")
    with pytest.raises(UserError, match="give --run-dir"):
        MetricsConfig(tracker="tensorboard")
    assert MetricsConfig(tracker="jsonl").metrics_path() is None  # no file asked for
    assert MetricsConfig(run_dir="r").metrics_path() == "r/metrics.jsonl"
    assert MetricsConfig(run_dir="r", tracker="tensorboard").metrics_path() is None


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_missing_package_is_a_named_error(monkeypatch, tmp_path, name):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as when not installed
    cfg = RunConfig(steps=1, metrics=MetricsConfig(run_dir=str(tmp_path), tracker=name))
    with pytest.raises(UserError, match=f"pip install {name}") as e:
        cfg.check_paths()
    assert e.value.exit_code == 2


def test_missing_package_exits_2_before_rendezvous(tmp_path):
    plan = tmp_path / "plan.json"
    save_plan(Plan("c", "", "gpt-tiny", [(0, 4)], [[0]]), plan)
    code = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, str(ROOT / "dist_runner.py"), "--plan",
                        str(plan), "--rank", "0", "--dist-url", "tcp://127.0.0.1:9", "--steps",
                        "1", "--fake-data", "--run-dir", str(tmp_path / "run"), "--tracker",
                        "jsonl,wandb"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert "--tracker wandb: the 'wandb' package is not installed" in p.stderr
    assert "Traceback" not in p.stderr


def test_wandb_offline_writes_locally_and_calls_nobody(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install -e .[wandb])")
    # Every address wandb could use points at this socket: nothing may connect to it.
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(8)
        url = f"http://127.0.0.1:{trap.getsockname()[1]}"
        for var in ("WANDB_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            monkeypatch.setenv(var, url)
        monkeypatch.delenv("WANDB_MODE", raising=False)
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
        log_all(MetricsConfig(run_dir=str(tmp_path), tracker="wandb"))
        trap.setblocking(False)
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody connected
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert not (tmp_path / "metrics.r1.jsonl").exists()  # jsonl not asked for


def two_rank_run(tmp_path, *flags: str):
    """A real 1 x 2 pipeline run of gpt-tiny on CPU (fake data, 4 steps) into tmp/run."""
    cluster = Cluster("two", [Device(i, f"d{i}", "A", "127.0.0.1", "cpu", 0.02, 8.0)
                              for i in range(2)], [[0, 1], [1, 0]], [[10, 10], [10, 10]])
    save_cluster(cluster, tmp_path / "cluster.json")
    plan = Plan("two", cluster.sha256(), "gpt-tiny", [(0, 2), (2, 4)], [[0, 1]],
                micro_batch_size=2, num_micro_batches=2)
    save_plan(plan, tmp_path / "plan.json")
    run = tmp_path / "run"
    p = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                  "--threads-per-rank", "1", "--", "--steps", "4", "--fake-data",
                  "--run-dir", str(run), "--eval-sequences", "2", "--eval-every", "2",
                  "--timeout-s", "60", *flags, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return plan, run


@pytest.mark.timeout(200)
def test_run_dir_and_plot_run_on_a_real_two_rank_run(tmp_path):
    has_tb = importlib.util.find_spec("tensorboard") is not None
    plan, run = two_rank_run(tmp_path, *(["--tracker", "jsonl,tensorboard"] if has_tb else []))
    if has_tb:  # the last stage of the one replica writes the event file
        assert len(list((run / "tensorboard" / "replica0").glob("events.out.tfevents.*"))) == 1
    rec = load_run(run)
    assert sorted(rec.replicas) == [0] and [r["step"] for r in rec.replicas[0]] == [1, 2, 3, 4]
    assert [r["val_loss"] > 0 for r in rec.replicas[0] if "val_loss" in r] == [True, True]
    for rank in (0, 1):
        recs = [json.loads(x) for x in rank_timing_path(run, rank).read_text().splitlines()]
        assert [r["step"] for r in recs] == [1, 2, 3, 4]
        assert all(set(r) == set(RANK_FIELDS) - {"fsdp_s"} for r in recs)  # no shard groups
        assert all(r["rank"] == rank and r["stage"] == rank for r in recs)
        for r in recs:
            assert r["compute_s"] + r["comm_s"] == pytest.approx(r["step_s"], abs=2e-6)
            assert 0 <= r["pp_wait_s"] <= r["comm_s"] + 1e-6
    assert load_plan(run / "plan.json").pipelines == plan.pipelines
    out = tmp_path / "run.png"
    p = run_entry("scripts/plot_run.py", str(run), "--out", str(out))
    assert p.returncode == 0, p.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert not list(tmp_path.glob(".run.png.*"))  # no temp file left


def test_plot_run_bad_inputs(tmp_path):
    p = run_entry("scripts/plot_run.py", str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such folder" in p.stderr
    p = run_entry("scripts/plot_run.py", str(tmp_path))
    assert p.returncode == 2 and "no metrics records" in p.stderr


@pytest.mark.parametrize("loss", ['"x"', "NaN", "1" + "0" * 400, None])
def test_plot_run_refuses_records_without_a_finite_loss(tmp_path, loss):
    lines = [{**r, "loss": "@"} if loss is not None else
             {k: v for k, v in r.items() if k != "loss"} for r in RECORDS]
    text = "".join(json.dumps(r).replace('"@"', str(loss)) + "\n" for r in lines)
    (tmp_path / "metrics.jsonl").write_text(text)
    p = run_entry("scripts/plot_run.py", str(tmp_path), "--out", str(tmp_path / "run.png"))
    assert p.returncode == 2 and "no metrics record has a finite loss" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "run.png").exists()


def test_plot_run_names_damaged_metrics_files_as_damaged(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1, "lo\n' + b"[" * 100_000 + b"\n")
    rank = rank_timing_path(tmp_path, 0)
    rank.parent.mkdir()
    rank.write_text(json.dumps({"step": 1, "rank": 0, "step_s": 1.0}) + "\n")
    p = run_entry("scripts/plot_run.py", str(tmp_path), "--out", str(tmp_path / "run.png"))
    assert p.returncode == 2, p.stderr
    assert "metrics.jsonl hold no readable record" in p.stderr and "Traceback" not in p.stderr
