"""int8 block codec: error bound, the rounding rules, edge inputs, NaN/inf refusal, CUDA kernel."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from modules.quant import NonFiniteError, dequantize_int8, quantize_int8
from modules.quant.codec import SCALE_CEIL, SCALE_FLOOR, quantize_int8_torch
from modules.quant.cuda import KERNEL_SOURCE, KERNELS

EPS = torch.finfo(torch.float32).eps


def error_and_bound(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|x - x'| and the documented bound scale/2 + 2^-23 |x|, per element."""
    q = quantize_int8(x, block)
    err = (x - dequantize_int8(q)).abs()
    half_scale = q.scales.repeat_interleave(block)[: x.numel()] / 2
    return err, half_scale + EPS * x.abs()


def numpy_reference(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented rules written out in numpy float32 (IEEE ops), block by block."""
    codes, scales = [], []
    for lo in range(0, x.size, block):
        b = x[lo: lo + block].astype(np.float32)
        scale = np.minimum(np.maximum(np.abs(b).max() / np.float32(127), np.float32(SCALE_FLOOR)),
                           np.float32(SCALE_CEIL))
        codes.append(np.clip(np.rint(b / scale), -127, 127).astype(np.int8))
        scales.append(scale)
    return np.concatenate(codes), np.array(scales, dtype=np.float32)


MAKERS = {
    "randn": lambda n: torch.randn(n),
    "constant": lambda n: torch.full((n,), 3.25),
    "zeros": lambda n: torch.zeros(n),
    "huge": lambda n: torch.randn(n) * 1e37,
    "tiny": lambda n: torch.randn(n) * 1e-30,
    "below-reciprocal-range": lambda n: torch.randn(n) * 1e-38,  # 127/absmax overflows fp32
    "denormal": lambda n: torch.randn(n) * 1e-43,
    "linspace": lambda n: torch.linspace(-5, 5, n),
    "max-float": lambda n: torch.full((n,), torch.finfo(torch.float32).max) * torch.sign(
        torch.randn(n)),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("n,block", [(1, 256), (1000, 256), (4096, 64), (777, 100)])
def test_error_is_at_most_half_a_scale(kind, n, block):
    torch.manual_seed(0)
    x = MAKERS[kind](n).to(torch.float32)
    err, bound = error_and_bound(x, block)
    assert torch.isfinite(err).all()
    assert (err <= bound).all(), float((err - bound).max())


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_codes_follow_the_documented_rules_exactly(kind):
    torch.manual_seed(1)
    x = MAKERS[kind](3000).to(torch.float32)
    q = quantize_int8(x, 128)
    codes, scales = numpy_reference(x.numpy(), 128)
    assert q.codes.numpy().tobytes() == codes.tobytes()
    assert q.scales.numpy().tobytes() == scales.tobytes()
    assert dequantize_int8(q).numpy().tobytes() == (
        np.repeat(scales, 128)[:3000] * codes.astype(np.float32)).tobytes()


def test_codes_use_the_full_range_and_round_half_to_even():
    q = quantize_int8(torch.tensor([0.0, -2.0, 1.0, 2.0, 127 / 254 * 2 * 0.25]), 5)
    # 1.0 / (2/127) = 63.5 -> 64 (even); 0.25 / (2/127) = 15.875 -> 16
    assert q.codes.tolist()[:4] == [0, -127, 64, 127]
    assert torch.equal(dequantize_int8(quantize_int8(torch.zeros(10), 4)), torch.zeros(10))


def test_tiny_blocks_do_not_saturate():
    x = torch.zeros(256)
    x[3], x[4] = 3e-37, -1e-37  # 127 / absmax overflows fp32: a reciprocal rule gave +-127/NaN
    q = quantize_int8(x, 256)
    assert q.scales.item() == SCALE_FLOOR  # FLT_MIN step below absmax 127 * FLT_MIN
    assert q.codes[3] == 26 and q.codes[4] == -9 and int(q.codes.abs().sum()) == 26 + 9
    assert float((x - dequantize_int8(q)).abs().max()) <= SCALE_FLOOR / 2


def test_constant_block_and_empty_tensor():
    x = torch.full((300,), -0.7)
    assert torch.equal(dequantize_int8(quantize_int8(x, 128)), x)
    q = quantize_int8(torch.zeros(0))
    assert q.codes.numel() == 0 and q.scales.numel() == 0 and dequantize_int8(q).numel() == 0


def test_shapes_and_dtypes():
    x = torch.randn(3, 5, 7)
    q = quantize_int8(x, 16)
    assert q.numel == 105 and q.codes.dtype == torch.int8 and q.scales.shape == (7,)
    with pytest.raises(TypeError, match="float32"):
        quantize_int8(x.double())
    with pytest.raises(ValueError, match="block"):
        quantize_int8(x, 0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_and_located(bad):
    x = torch.randn(50)
    x[17] = bad
    x[40] = bad
    with pytest.raises(NonFiniteError, match=r"2 NaN/inf values of 50 \(first at index 17"):
        quantize_int8(x)


def test_int8_payload_is_a_quarter_of_fp32():
    q = quantize_int8(torch.randn(1 << 16), 256)
    assert q.nbytes() / (4 * (1 << 16)) == pytest.approx(0.25 + 1 / 256)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed: cannot compile "
                    "the CUDA kernel to PTX on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cuda_kernel_compiles_to_ptx_with_ieee_division(tmp_path, arch):
    out = tmp_path / f"int8_{arch}.ptx"
    # -ftz=true as cupy.RawModule always adds it (tests/test_gpu_seams.py: cupy's options)
    r = subprocess.run(["nvcc", "-ptx", "-ftz=true", f"-arch={arch}", "-o", str(out),
                        str(KERNEL_SOURCE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    for kernel in KERNELS:
        assert f".entry {kernel}" in text
    # the rules need correctly rounded division and kept denormals (no approx/ftz variants)
    assert "div.rn.f32" in text
    assert "div.approx" not in text and "div.full" not in text and ".ftz" not in text


def _cuda_ready() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


gpu = [pytest.mark.gpu, pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device "
                                           "and cupy (the gpu extra: cupy-cuda13x)")]


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("n,block", [(1_000_003, 256), (4097, 100), (70, 64)])
@gpu[0]
@gpu[1]
def test_cuda_codes_match_cpu_bit_for_bit(kind, n, block):
    from modules.quant.cuda import dequantize_int8_cuda, quantize_int8_cuda

    torch.manual_seed(1)
    x = MAKERS[kind](n).to(torch.float32)
    cpu = quantize_int8_torch(x, block)
    dev = quantize_int8_cuda(x.cuda(), block)
    assert cpu.codes.numpy().tobytes() == dev.codes.cpu().numpy().tobytes()
    assert cpu.scales.numpy().tobytes() == dev.scales.cpu().numpy().tobytes()
    assert dequantize_int8(cpu).numpy().tobytes() == \
        dequantize_int8_cuda(dev).cpu().numpy().tobytes()


@gpu[0]
@gpu[1]
def test_cuda_refuses_non_finite_and_locates_it():
    x = torch.randn(100_000, device="cuda")
    x[70_001] = float("nan")
    with pytest.raises(NonFiniteError, match="1 NaN/inf values of 100000 \\(first at index 70001"):
        quantize_int8(x)


@gpu[0]
@gpu[1]
def test_cuda_kernel_throughput_is_measured():
    """Prints GB/s of the fused quantise kernel; asserts only that it beats the torch path."""
    from modules.quant.cuda import quantize_int8_cuda

    x = torch.randn(64 << 20, device="cuda")
    rates = {}
    for name, fn in (("kernel", quantize_int8_cuda), ("torch", quantize_int8_torch)):
        fn(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn(x)
        end.record()
        torch.cuda.synchronize()
        rates[name] = 5 * x.numel() * 5 / (start.elapsed_time(end) / 1e3) / 1e9  # read 4 + write 1
    print(f"quantise DRAM traffic GB/s: {rates}")
    assert rates["kernel"] > rates["torch"]


def test_non_finite_deep_in_a_large_tensor_is_located():
    x = torch.randn(300_001)  # several CPU chunks and a partial last block
    x[200_017] = float("-inf")
    x[300_000] = float("nan")
    with pytest.raises(NonFiniteError, match=r"2 NaN/inf values of 300001 \(first at index 200017"):
        quantize_int8(x, 256)
