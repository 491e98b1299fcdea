"""Pipeline compression (plan.pipeline_compression / --pipeline-compression): the per-row int8
codec's error bounds and non-finite rows, bf16's, a 2-stage PipelineStage run whose losses and
gradients stay close to `none` while its link bytes fall 2x / ~4x, the runtime's metrics, and
the flag's bad values."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from formats.models import get_model
from formats.plan import Plan, save_plan
from modules.comm import CommStats, Posted
from modules.control.dist import topology
from modules.device.precision import Precision
from modules.model.decoder import StageModel
from modules.pipeline.stage import PipelineStage
from modules.pipeline.wire import PipelineWire, message_bytes
from modules.quant.rows import decode_rows, encode_rows, row_message_bytes
from modules.train.metrics import read_metrics
from tests.conftest import run_entry

EPS = torch.finfo(torch.float32).eps
SPEC = get_model("gpt-tiny")
PLAN = Plan("local", "", "gpt-tiny", [(0, 2), (2, 4)], [[0, 1]], micro_batch_size=2,
            num_micro_batches=3)
SHAPE = (PLAN.micro_batch_size, SPEC.seq_len, SPEC.d_model)


# -- the codecs ----------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_int8_rows_error_is_at_most_half_a_step_of_the_row(scale):
    torch.manual_seed(0)
    x = torch.randn(3, 17, 96) * scale * torch.rand(3, 17, 1) * 10  # rows of different sizes
    x[0, 0] = 0.0  # an all-zero row decodes to zeros
    y = decode_rows(encode_rows(x), x.shape)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((x - y).abs() <= step / 2 + EPS * x.abs()).all()
    assert torch.equal(y[0, 0], torch.zeros(96))
    assert encode_rows(x).numel() == row_message_bytes(x.shape) == 3 * 17 * (96 + 4)


def test_int8_rows_are_the_block_codec_with_one_block_per_row():
    """Same bytes as modules.quant's block codec (CPU rules = CUDA kernel) with block = d."""
    from modules.quant import quantize_int8

    x = torch.randn(4, 8, 64)
    q = quantize_int8(x.reshape(-1), 64)
    msg = encode_rows(x)
    assert msg[: 4 * 32].view(torch.float32).tolist() == q.scales.tolist()
    assert torch.equal(msg[4 * 32:].view(torch.int8), q.codes)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_int8_rows_with_non_finite_values_decode_to_nan_rows(bad):
    """A non-finite activation must not become finite garbage: its whole row arrives NaN (the
    receiver's gradients turn NaN, which fp16's overflow check skips and the trainer's
    non-finite check stops on); the other rows are untouched by it."""
    x = torch.randn(2, 5, 32)
    x[1, 2, 7] = bad
    y = decode_rows(encode_rows(x), x.shape)
    assert torch.isnan(y[1, 2]).all()
    rest = torch.ones(2, 5, dtype=torch.bool)
    rest[1, 2] = False
    assert torch.isfinite(y[rest]).all()
    assert torch.equal(y[rest], decode_rows(encode_rows(torch.where(rest[..., None], x, 0)),
                                            x.shape)[rest])


def test_bf16_relative_error_and_non_finite_values():
    wire = PipelineWire("bf16")
    x = torch.randn(2, 16, 64) * torch.logspace(-20, 20, 64)
    y = wire.decode(wire.encode(x), x.shape)
    assert ((x - y).abs() <= x.abs() * 2.0 ** -8).all()
    x[0, 0, 0], x[1, 1, 1] = float("inf"), float("nan")
    y = wire.decode(wire.encode(x), x.shape)  # bf16 keeps inf and NaN as they are
    assert y[0, 0, 0] == float("inf") and torch.isnan(y[1, 1, 1])


def test_message_bytes_per_mode_and_precision():
    n = 2 * 64 * 128
    assert message_bytes("none", SHAPE, 4) == 4 * n
    assert message_bytes("none", SHAPE, 2) == 2 * n
    assert message_bytes("bf16", SHAPE) == 2 * n
    assert message_bytes("int8", SHAPE) == n + 4 * 2 * 64
    cpu = torch.device("cpu")
    assert PipelineWire("none", Precision("bf16", cpu)).nbytes(SHAPE) == 2 * n
    for mode in ("none", "bf16", "int8"):
        wire = PipelineWire(mode, Precision("fp32", cpu))
        buf = wire.buffer(SHAPE, cpu)
        assert buf.numel() * buf.element_size() == wire.nbytes(SHAPE)
    with pytest.raises(ValueError, match="fp8"):
        PipelineWire("fp8")


def _cuda_ready() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and cupy (the gpu extra)")
@pytest.mark.parametrize("shape", [(2, 1024, 2048), (3, 7, 100), (1, 1, 8192)])
def test_cuda_rows_match_cpu_bit_for_bit(shape):
    """int8.cu with one warp per token row writes the CPU path's message (scripts/gpu_rows.py
    also runs this comparison)."""
    from scripts.gpu_rows import row_codec_mismatch

    assert row_codec_mismatch("cuda", shape) == ""


def test_the_gpu_checks_comparison_passes_on_the_cpu(monkeypatch):
    """The comparison scripts/gpu_rows.py runs on a GPU, run against the CPU itself: it finds
    no difference, and it finds a corrupted message."""
    from modules.quant import rows
    from scripts import gpu_rows

    assert gpu_rows.row_codec_mismatch("cpu", (2, 9, 64)) == ""
    calls = []
    real = rows.encode_rows

    def corrupt_second(x):
        calls.append(1)
        msg = real(x)
        if len(calls) == 2:  # the "device" path
            msg[200] ^= 1
        return msg

    monkeypatch.setattr(rows, "encode_rows", corrupt_second)
    assert gpu_rows.row_codec_mismatch("cpu", (2, 9, 64)) == \
        "1 of 1224 message bytes differ from the CPU path"


# -- a 2-stage pipeline in two threads -------------------------------------------------------
class ThreadComm:
    """The point-to-point part of a Communicator between threads of one process. Like gloo, a
    message must fit its posted buffer exactly (same dtype and size); bytes are counted as gloo
    counts them (the sent tensor's payload)."""

    def __init__(self, rank: int, boxes: dict, lock: threading.Lock) -> None:
        self.rank, self.boxes, self.lock = rank, boxes, lock
        self.stats, self.bytes_sent = CommStats(), 0

    def _box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), queue.Queue())

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Posted:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self._box(self.rank, dst, tag).put(tensor.clone())
        return Posted(dst, "send", None, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Posted:
        return Posted(src, "recv", self._box(src, self.rank, tag), tensor)

    def wait(self, posted: Posted, what: str | None = None) -> torch.Tensor:
        if posted.kind == "recv":
            got = posted.handle.get(timeout=60)
            assert got.dtype == posted.buffer.dtype and got.shape == posted.buffer.shape, what
            posted.buffer.copy_(got)
        return posted.buffer

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0,
             what: str | None = None) -> torch.Tensor:
        return self.wait(self.irecv(tensor, src, tag), what)


def run_pipeline(compression: str, steps: int = 1, precision: str = "fp32", seed: int = 0):
    """Train `steps` AdamW steps of PLAN's 2-stage pipeline (PipelineStage in two threads) on
    one batch of seeded random tokens (memorised, so the loss falls); returns (losses, stage
    gradients after step 1, bytes sent per rank)."""
    boxes, lock = {}, threading.Lock()
    stages, comms, opts = [], [], []
    for rank, (a, b) in enumerate(PLAN.stages):
        model = StageModel(SPEC, a, b, seed=seed)
        comm = ThreadComm(rank, boxes, lock)
        stages.append(PipelineStage(model, topology(PLAN, rank, 2), comm, PLAN.micro_batch_size,
                                    Precision(precision, torch.device("cpu")), compression))
        comms.append(comm)
        opts.append(torch.optim.AdamW(model.parameters(), lr=3e-3))
    tokens = torch.randint(0, SPEC.vocab_size, (PLAN.num_micro_batches, PLAN.micro_batch_size,
                                                SPEC.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    xs, ys = list(tokens[..., :-1]), list(tokens[..., 1:])
    losses, grads, errors = [], [], []

    def work(rank: int, x, y) -> None:
        try:
            out = stages[rank].train_step(x if rank == 0 else None, y if rank == 1 else None,
                                          PLAN.num_micro_batches)
            if out is not None:
                losses.append(out)
        except Exception as e:  # surfaced in the main thread
            errors.append(e)

    for step in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        threads = [threading.Thread(target=work, args=(r, xs, ys)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        if step == 0:
            grads = [torch.cat([p.grad.reshape(-1) for p in s.model.parameters()])
                     for s in stages]
        for o in opts:
            o.step()
    assert [s.bytes_sent for s in stages] == [c.bytes_sent for c in comms]
    return losses, grads, [c.bytes_sent for c in comms]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    return {mode: run_pipeline(mode, steps=4) for mode in ("none", "bf16", "int8")}


# Measured (gpt-tiny, 4 steps): relative gradient error of stage 0 / stage 1 bf16 1.6e-3 /
# 7.9e-4, int8 6.0e-3 / 3.3e-3; losses within 4e-5 relative. The bars leave ~5x margin; a wrong
# scale, a dropped row or a message decoded into the wrong micro-batch give errors of order 1.
GRAD_REL = {"bf16": 0.01, "int8": 0.03}
LOSS_REL = 2e-3


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_compressed_pipeline_trains_like_uncompressed(runs, mode):
    loss0, grads0, _ = runs["none"]
    loss, grads, _ = runs[mode]
    assert loss0[-1] < loss0[0]  # it trains
    print(mode, "gradient rel. errors", [rel(g, g0) for g, g0 in zip(grads, grads0)],
          "losses", loss, loss0)
    for g, g0 in zip(grads, grads0):
        assert rel(g, g0) < GRAD_REL[mode], (mode, rel(g, g0))
    for a, b in zip(loss, loss0):
        assert abs(a - b) / b < LOSS_REL, (mode, loss, loss0)
    # stage 1 received compressed activations, stage 0 compressed gradients: both differ
    assert rel(grads[0], grads0[0]) > 0 and rel(grads[1], grads0[1]) > 0


def test_link_bytes_fall_2x_for_bf16_and_about_4x_for_int8(runs):
    n = PLAN.num_micro_batches * 2 * 64 * 128  # values per step in each direction
    per_step = {mode: [b / 4 for b in r[2]] for mode, r in runs.items()}
    assert per_step["none"] == [4 * n, 4 * n]  # fp32: activations forward, gradients back
    assert per_step["bf16"] == [2 * n, 2 * n]
    rows = PLAN.num_micro_batches * 2 * 64
    assert per_step["int8"] == [n + 4 * rows, n + 4 * rows]
    assert per_step["none"][0] / per_step["int8"][0] == pytest.approx(4 * 128 / 132)


def test_int8_with_bf16_compute_and_none_in_bf16():
    """--precision bf16: `none` sends bf16 (as before), int8 still sends d + 4 bytes a row."""
    loss_b, grads_b, sent_b = run_pipeline("none", precision="bf16")
    loss_i, grads_i, sent_i = run_pipeline("int8", precision="bf16")
    n = PLAN.num_micro_batches * 2 * 64 * 128
    assert sent_b == [2 * n, 2 * n]
    assert sent_i == [n + 4 * n // 128] * 2
    assert abs(loss_i[0] - loss_b[0]) / loss_b[0] < LOSS_REL
    assert rel(grads_i[0], grads_b[0]) < 0.05


@pytest.mark.parametrize("mode", ["none", "bf16", "int8"])
def test_an_inf_activation_reaches_the_next_stage_as_non_finite(mode):
    """Stage 0's output holds inf in one token: whatever the wire, stage 1's loss is not finite
    and stage 0's gradients are NaN, so the trainer's check (or fp16's skip) sees it."""
    boxes, lock = {}, threading.Lock()
    stages = []
    for rank, (a, b) in enumerate(PLAN.stages):
        model = StageModel(SPEC, a, b, seed=0)
        stages.append(PipelineStage(model, topology(PLAN, rank, 2), ThreadComm(rank, boxes, lock),
                                    PLAN.micro_batch_size, compression=mode))
    emb = next(p for n, p in stages[0].model.named_parameters() if "emb" in n)
    with torch.no_grad():
        emb[5] = float("inf")  # token 5's embedding
    xs = [torch.full((PLAN.micro_batch_size, SPEC.seq_len), 5)] * PLAN.num_micro_batches
    out = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(
        r, stages[r].train_step(xs if r == 0 else None, xs if r == 1 else None,
                                PLAN.num_micro_batches))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not torch.isfinite(torch.tensor(out[1]))
    grads = [p.grad for n, p in stages[0].model.named_parameters() if "emb" not in n]
    assert not all(torch.isfinite(g).all() for g in grads)


# -- the runtime -----------------------------------------------------------------------------
@pytest.mark.timeout(200)
@pytest.mark.parametrize("plan_mode,flag,used", [("none", "int8", "int8"), ("bf16", None, "bf16")])
def test_runtime_takes_the_flag_else_the_plan_and_metrics_count_wire_bytes(tmp_path, plan_mode,
                                                                           flag, used):
    """dist_runner over gloo (posted receives of the encoded size): --pipeline-compression
    overrides the plan's value, else the plan's is used; the last stage's pp_bytes_sent is its
    encoded gradient messages, and its bytes_sent holds them (plus the tied-embedding sum)."""
    plan = Plan("local", "", "gpt-tiny", PLAN.stages, PLAN.pipelines, PLAN.micro_batch_size,
                PLAN.num_micro_batches, pipeline_compression=plan_mode)
    save_plan(plan, tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    r = run_entry("scripts/launch_local.py", "--plan", str(tmp_path / "plan.json"),
                  "--threads-per-rank", "1", "--grace-s", "2", "--", "--metrics", str(metrics),
                  "--timeout-s", "60", "--steps", "2", "--fake-data",
                  *(["--pipeline-compression", flag] if flag else []), timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(f"pipeline compression {used}") == 2  # each rank says which it uses
    recs = read_metrics(metrics)
    want = PLAN.num_micro_batches * message_bytes(used, SHAPE, 4)
    assert [rec["pp_bytes_sent"] for rec in recs] == [want, want]
    for rec in recs:  # the rank's total = pipeline messages + the tied-embedding sum (fp32)
        assert rec["bytes_sent"] - rec["pp_bytes_sent"] == 4 * SPEC.vocab_size * SPEC.d_model
        assert rec["loss"] == rec["loss"]  # finite, not NaN


@pytest.mark.parametrize("value", ["fp8", "INT8", ""])
def test_bad_flag_value_exits_2_naming_the_flag(tmp_path, value):
    save_plan(PLAN, tmp_path / "plan.json")
    r = run_entry("dist_runner.py", "--plan", str(tmp_path / "plan.json"), "--rank", "0",
                  "--steps", "1", "--pipeline-compression", value, timeout=60)
    assert r.returncode == 2
    assert "--pipeline-compression" in r.stderr and repr(value) in r.stderr


def test_config_checks_the_value_and_falls_back_to_the_plan():
    from formats.errors import UserError
    from modules.config import DeviceConfig

    with pytest.raises(UserError, match=r"--pipeline-compression: must be one of none, bf16, "
                       r"int8, got 'fp8'"):
        DeviceConfig(pipeline_compression="fp8")
    plan = Plan("local", "", "gpt-tiny", PLAN.stages, PLAN.pipelines,
                pipeline_compression="bf16")
    assert DeviceConfig().resolved_pipeline_compression(plan) == "bf16"
    assert DeviceConfig(pipeline_compression="none").resolved_pipeline_compression(plan) == "none"
