"""DiLoCoOptimizer on its own: the outer update formula, degenerate cases, state round trip,
and two workers averaging through a user-supplied all_reduce_fn."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys
import threading

import pytest
import torch

from modules.sync.diloco import DiLoCoOptimizer
from tests.conftest import ROOT


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _halve(t: torch.Tensor) -> None:
    """Average with a simulated worker whose parameters did not move."""
    t.mul_(0.5)


def _train(model, opt, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_h1_lr1_no_momentum_equals_inner_optimizer():
    a, b = _model(), _model()
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2)
    dl = DiLoCoOptimizer(b.parameters(), torch.optim.AdamW(b.parameters(), lr=1e-2),
                         outer_lr=1.0, outer_momentum=0.0, inner_steps=1)
    assert _train(a, plain, 5) == _train(b, dl, 5)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7)


def test_communicates_only_every_h_steps_and_counts_bytes():
    model = _model()
    calls = []
    opt = DiLoCoOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1),
                          inner_steps=3, all_reduce_fn=lambda t: calls.append(t.numel()))
    _train(model, opt, 7)
    n = sum(p.numel() for p in model.parameters())
    assert calls == [n, n]  # after inner steps 3 and 6 only
    assert opt.outer_count == 2 and opt.inner_count == 1
    assert opt.bytes_sent == 2 * 4 * n  # fp32 payload when the function does not say


def test_outer_step_formula_exact():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    inner = torch.optim.SGD([w], lr=1.0)
    opt = DiLoCoOptimizer([w], inner, outer_lr=0.5, outer_momentum=0.9, inner_steps=1,
                          all_reduce_fn=_halve)
    w.grad = torch.tensor([0.2, -0.4])  # inner step: w -> [0.8, 2.4]; pseudo = [0.2, -0.4]
    opt.step()
    g = torch.tensor([0.1, -0.2])  # averaged with a worker that did not move
    expected = torch.tensor([1.0, 2.0]) - 0.5 * (g + 0.9 * g)
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(opt.anchor[0], expected)


def test_state_dict_round_trip_continues_identically():
    a = _model()
    mk = lambda m: DiLoCoOptimizer(m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-2),
                                   inner_steps=3)
    opt_a = mk(a)
    _train(a, opt_a, 4)
    b = _model(seed=9)
    b.load_state_dict(a.state_dict())
    opt_b = mk(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as if through torch.save
    assert _train(a, opt_a, 5, seed=3) == _train(b, opt_b, 5, seed=3)


def test_two_workers_with_threads_end_each_outer_step_identical():
    """Two workers on different data, averaging through a thread barrier."""
    models = [_model(), _model()]
    slots: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2, timeout=30)

    def make_reduce(i):
        def reduce(t: torch.Tensor) -> int:
            slots[i] = t.clone()
            barrier.wait()
            t.copy_((slots[0] + slots[1]) / 2)
            barrier.wait()
            return t.numel() * 4
        return reduce

    opts = [DiLoCoOptimizer(m.parameters(), torch.optim.AdamW(m.parameters(), lr=1e-2),
                            inner_steps=4, all_reduce_fn=make_reduce(i))
            for i, m in enumerate(models)]
    threads = [threading.Thread(target=_train, args=(models[i], opts[i], 8, 10 + i))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opts[0].outer_count == opts[1].outer_count == 2
    for pa, pb in zip(*(m.parameters() for m in models)):
        assert torch.equal(pa, pb)


# The example of docs/runtime.md, verbatim (tests/test_docs_links.py checks): it must run
# alone and under torchrun.
README_EXAMPLE = """\
import os

import torch
import torch.distributed as dist

from modules.sync.diloco import DiLoCoOptimizer

if "WORLD_SIZE" in os.environ:  # under torchrun: average over the workers (gloo on CPU)
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0

torch.manual_seed(0)  # every worker starts from the same weights
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
opt = DiLoCoOptimizer(model.parameters(), inner, outer_lr=0.7, outer_momentum=0.9,
                      inner_steps=10)  # all_reduce_fn defaults to torch.distributed's average

gen = torch.Generator().manual_seed(1 + rank)  # each worker sees its own data
for step in range(100):
    x = torch.randn(32, 16, generator=gen)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()  # an inner AdamW step; every 10th call also the outer (communicating) step
print(f"worker {rank}: loss {loss.item():.4f}, outer steps {opt.outer_count}, "
      f"bytes sent {opt.bytes_sent}, first weight {model[0].weight[0, 0].item():.6f}")
if dist.is_initialized():  # leave together, then close gloo's connections before exiting
    dist.barrier()
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_readme_example_runs_alone_and_under_torchrun(tmp_path):
    script = tmp_path / "diloco_example.py"
    script.write_text(README_EXAMPLE)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env=env, timeout=60)
    assert alone.returncode == 0, alone.stderr
    assert "outer steps 10, bytes sent 0" in alone.stdout
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                         capture_output=True, text=True, env=env, timeout=100)
    assert two.returncode == 0, two.stderr[-2000:]
    # the two workers' lines may interleave on the shared stdout: match, do not split lines
    found = re.findall(r"worker (\d): loss [\d.]+, outer steps 10, bytes sent (\d+), "
                       r"first weight (-?\d\.\d{6})", two.stdout)
    assert sorted(w for w, _, _ in found) == ["0", "1"], two.stdout
    n = sum(p.numel() for p in torch.nn.Sequential(torch.nn.Linear(16, 64),
                                                    torch.nn.Linear(64, 1)).parameters())
    assert all(int(b) == 10 * 4 * n for _, b, _ in found)
    # both workers end on the same weights (the last call was an outer step)
    assert found[0][2] == found[1][2]


@pytest.mark.parametrize("outer_steps", [0, 2])
def test_outer_state_handed_to_a_fresh_optimizer_continues_identically(outer_steps):
    """What a live replica hands a joiner (outer model, momentum, count) makes the joiner's
    next outer steps bit-identical to the live replica's, given the same pseudo-gradients."""
    live = _model(0)
    opt = DiLoCoOptimizer(live.parameters(), torch.optim.SGD(live.parameters(), lr=0.1),
                          inner_steps=3, all_reduce_fn=_halve)
    _train(live, opt, 3 * outer_steps + 1)  # one inner step past the last outer step
    state = opt.outer_state()
    assert state.outer_count == outer_steps
    assert (state.momentum is None) == (outer_steps == 0)
    joiner = _model(5)  # other weights: everything must come from the state
    jopt = DiLoCoOptimizer(joiner.parameters(), torch.optim.SGD(joiner.parameters(), lr=0.1),
                           inner_steps=3, all_reduce_fn=_halve)
    jopt.load_outer_state(copy.deepcopy(state))
    assert jopt.outer_count == outer_steps and jopt.inner_count == 0
    for a, b in zip(joiner.parameters(), opt.anchor):
        assert torch.equal(a, b)  # the joiner starts from the outer model
    for p, a in zip(live.parameters(), opt.anchor):  # and so does the live one's next step
        p.data.copy_(a)
    for o in (opt, jopt):
        o.outer_step()
        o.outer_step()
    for a, b in zip(live.parameters(), joiner.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="outer state: 3 values"):
        jopt.load_outer_state(type(state)(torch.zeros(3), None, 0))


def test_the_default_outer_optimizer_is_the_nesterov_sgd_factory():
    from modules.sync.diloco import nesterov_sgd

    a, b = _model(), _model()
    da = DiLoCoOptimizer(a.parameters(), torch.optim.AdamW(a.parameters(), lr=1e-2),
                         outer_lr=0.7, outer_momentum=0.9, inner_steps=2, all_reduce_fn=_halve)
    db = DiLoCoOptimizer(b.parameters(), torch.optim.AdamW(b.parameters(), lr=1e-2),
                         inner_steps=2, all_reduce_fn=_halve,
                         outer_optimizer=nesterov_sgd(0.7, 0.9))
    assert _train(a, da, 6) == _train(b, db, 6)  # bit-identical
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_any_outer_optimizer_steps_the_anchor_with_the_averaged_pseudo_gradient():
    """Adam as the outer optimizer: after one round the parameters are exactly what Adam gives
    the starting weights with the averaged pseudo-gradient as their gradient; its outer state
    carries the model and count (no SGD momentum), and a joiner built the same way loads it."""
    def adam(anchors):
        return torch.optim.Adam(anchors, lr=0.05)

    sent = []

    def average(t: torch.Tensor) -> None:
        t.mul_(0.5)  # as _halve, keeping the average the outer step is given
        sent.append(t.clone())

    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = DiLoCoOptimizer(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1),
                          inner_steps=3, all_reduce_fn=average, outer_optimizer=adam)
    assert all(isinstance(o, torch.optim.Adam) for o in opt.outers)
    _train(model, opt, 3)
    assert len(sent) == 1
    ref, off = [], 0
    for s in start:
        ref.append(s.clone().requires_grad_(True))
        ref[-1].grad = sent[0][off:off + s.numel()].view_as(s).clone()
        off += s.numel()
    torch.optim.Adam(ref, lr=0.05).step()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-7)
    state = opt.outer_state()
    assert state.momentum is None and state.outer_count == 1
    joiner_model = _model(seed=5)
    joiner = DiLoCoOptimizer(joiner_model.parameters(),
                             torch.optim.SGD(joiner_model.parameters(), lr=0.1), inner_steps=3,
                             all_reduce_fn=_halve, outer_optimizer=adam)
    joiner.load_outer_state(state)
    for p, q in zip(joiner_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
