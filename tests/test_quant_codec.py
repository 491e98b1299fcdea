"""int8 block codec: error bound, edge inputs, NaN/inf refusal, the CUDA kernel compiles."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from modules.quant import NonFiniteError, dequantize_int8, quantize_int8
from modules.quant.cuda import KERNEL_SOURCE


def within_bound(x: torch.Tensor, block: int) -> bool:
    q = quantize_int8(x, block)
    err = (x - dequantize_int8(q)).abs()
    half_scale = q.scales.repeat_interleave(block)[: x.numel()] / 2
    # scale/2 plus fp32 rounding of the two products (a few ulp of |x|).
    return bool((err <= half_scale + 4 * torch.finfo(torch.float32).eps * x.abs() + 1e-45).all())


@pytest.mark.parametrize("make", [
    lambda n: torch.randn(n),
    lambda n: torch.full((n,), 3.25),
    lambda n: torch.zeros(n),
    lambda n: torch.randn(n) * 1e30,
    lambda n: torch.randn(n) * 1e-30,
    lambda n: torch.linspace(-5, 5, n),
])
@pytest.mark.parametrize("n,block", [(1, 256), (1000, 256), (4096, 64), (777, 100)])
def test_error_is_at_most_half_a_scale(make, n, block):
    torch.manual_seed(0)
    x = make(n).to(torch.float32)
    assert within_bound(x, block)


def test_codes_use_the_full_range_and_zeros_stay_zero():
    x = torch.tensor([0.0, -2.0, 1.0, 2.0])
    q = quantize_int8(x, 4)
    assert q.codes.tolist() == [0, -127, 64, 127]  # 63.5 rounds half to even -> 64
    assert torch.equal(dequantize_int8(quantize_int8(torch.zeros(10), 4)), torch.zeros(10))


def test_constant_block_is_exact():
    x = torch.full((300,), -0.7)
    assert torch.equal(dequantize_int8(quantize_int8(x, 128)), x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_and_located(bad):
    x = torch.randn(50)
    x[17] = bad
    with pytest.raises(NonFiniteError, match="first at index 17"):
        quantize_int8(x)


def test_int8_payload_is_a_quarter_of_fp32():
    q = quantize_int8(torch.randn(1 << 16), 256)
    assert q.nbytes() / (4 * (1 << 16)) == pytest.approx(0.25 + 1 / 256)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot compile "
                    "the CUDA kernel to PTX on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernel_compiles_to_ptx(tmp_path, arch):
    out = tmp_path / f"int8_{arch}.ptx"
    r = subprocess.run(["nvcc", "-ptx", f"-arch={arch}", "-o", str(out), str(KERNEL_SOURCE)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for kernel in ("block_absmax", "quantize", "dequantize"):
        assert f".entry {kernel}" in text


def _cuda_ready() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and cupy (the gpu extra)")
def test_cuda_codes_match_cpu_bit_for_bit():
    from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda

    torch.manual_seed(1)
    x = torch.randn(1_000_003) * 7
    cpu = quantize_int8(x, 256)
    gpu = quantize_int8_cuda(x.cuda(), 256)
    assert torch.equal(cpu.codes, gpu.codes.cpu())
    assert torch.equal(cpu.scales, gpu.scales.cpu())
    assert torch.equal(dequantize_int8(cpu), dequantize_int8_cuda(gpu).cpu())
