"""DiLoCoOptimizer on its own: the outer update formula, degenerate cases, state round trip,
and two workers averaging through a user-supplied all_reduce_fn."""

from __future__ import annotations

import copy
import threading

import torch

from modules.diloco import DiLoCoOptimizer


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
