"""Model FLOPs per token and MFU: exact values on gpt-tiny, and the 6N + attention identity
against formats.models (which the planner's simulator uses) on every preset."""

from __future__ import annotations

import pytest

from formats.errors import UserError
from formats.models import PRESETS, get_model
from modules.device.mfu import check_peak_tflops, flops_per_token, mfu, resolve_peak_tflops

TINY = get_model("gpt-tiny")  # L=4, d=128, d_ff=512, T=64, vocab 256


def test_gpt_tiny_flops_per_token_exact():
    # per layer forward: 2 x (4 d^2 + 2 d f) + 4 T d = 2 x 196608 + 32768 = 425984
    # head forward: 2 x 256 x 128 = 65536; training = 3 x (4 x 425984 + 65536)
    assert flops_per_token(TINY) == 5_308_416
    assert flops_per_token(TINY, 0, 2) == 3 * 2 * 425_984
    assert flops_per_token(TINY, 2, 4) == 3 * (2 * 425_984 + 65_536)
    assert flops_per_token(TINY, 0, 2) + flops_per_token(TINY, 2, 4) == flops_per_token(TINY)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_six_n_plus_attention_on_every_preset(name):
    spec = get_model(name)
    d, f, L, T = spec.d_model, spec.d_ff, spec.num_layers, spec.seq_len
    mlp = (2 if spec.arch == "gpt" else 3) * d * f
    n_matmul = L * (4 * d * d + mlp) + spec.vocab_size * d  # blocks + LM head
    assert flops_per_token(spec) == 6 * n_matmul + 12 * L * T * d


def test_mfu_exact_and_none_without_a_peak():
    assert mfu(10_000, 5_308_416, 1.0) == pytest.approx(0.05308416, rel=1e-12)
    assert mfu(2e5, flops_per_token(get_model("gpt-small")), 312.0) == pytest.approx(
        2e5 * 3 * (6 * (2 * (4 * 384**2 + 2 * 384 * 1536) + 4 * 128 * 384) + 2 * 256 * 384)
        / 312e12, rel=1e-12)
    assert mfu(10_000, 5_308_416, None) is None


def test_peak_comes_from_the_flag_then_the_cluster_else_none():
    assert resolve_peak_tflops(989.0, 125.0) == 989.0
    assert resolve_peak_tflops(None, 125.0) == 125.0
    assert resolve_peak_tflops(None, None) is None  # e.g. a CPU rank: MFU left out


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_peak_is_a_user_error_naming_the_flag(bad):
    with pytest.raises(UserError, match=r"^--peak-tflops: must be a positive number"):
        check_peak_tflops(bad)
    with pytest.raises(UserError, match=r"^--peak-tflops"):
        resolve_peak_tflops(bad, 100.0)
