// Block-wise int8 quantisation of a flat fp32 tensor, bit-identical to modules/quant/codec.py.
//
// Rounding rules (shared with the CPU path; every operation IEEE fp32, round to nearest even):
//   absmax = max |x| over the block                        (exact)
//   scale  = min(max(absmax / 127, 2^-126), SCALE_CEIL)    (__fdiv_rn; floor = FLT_MIN: never 0
//                                                           or denormal; ceiling: 127 * scale
//                                                           stays finite)
//   code   = clamp(rint(x / scale), -127, 127)             (__fdiv_rn, rintf = half to even)
//   x'     = (float)code * scale                           (__fmul_rn: no FMA contraction)
// Compile without --use_fast_math / -ftz=true: denormals must be kept, as on the CPU.
//
// One warp per quantisation block: the lanes stride over the block (coalesced loads), reduce the
// absmax with shuffles, then quantise; the second read of the block hits L1/L2, so DRAM traffic
// is 4 bytes in + 1 byte out (+ 4 per block) per element. The same pass counts NaN/inf values,
// so detecting them costs no extra read of the input. Only builtins and intrinsics are used
// (no headers), so NVRTC (cupy.RawModule) and nvcc compile the same source.

#define WARP 32
#define FULL_MASK 0xffffffffu
#define SCALE_FLOOR_BITS 0x00800000  // 2^-126 = FLT_MIN
#define SCALE_CEIL_BITS 0x7c010203   // 2.6793884e36: largest s with 127 * s < inf

extern "C" __global__ void quantize_blocks(const float* __restrict__ x,
                                           signed char* __restrict__ codes,
                                           float* __restrict__ scales,
                                           unsigned long long* __restrict__ nonfinite,
                                           long long n, int block, long long nblocks) {
    const int lane = threadIdx.x % WARP;
    const long long first_warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) / WARP;
    for (long long b = first_warp; b < nblocks; b += nwarps) {  // uniform across the warp
        const long long start = b * block;
        const long long end = start + block < n ? start + block : n;
        float m = 0.0f;
        unsigned int bad = 0;
        for (long long k = start + lane; k < end; k += WARP) {
            const float v = x[k];
            bad += fabsf(v) <= 3.40282347e+38f ? 0u : 1u;  // false for NaN and +-inf
            m = fmaxf(m, fabsf(v));  // fmaxf ignores NaN; NaN/inf are reported, not used
        }
        for (int off = WARP / 2; off > 0; off >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, off));
            bad += __shfl_xor_sync(FULL_MASK, bad, off);
        }
        if (lane == 0 && bad) atomicAdd(nonfinite, (unsigned long long)bad);
        const float scale = fminf(fmaxf(__fdiv_rn(m, 127.0f), __int_as_float(SCALE_FLOOR_BITS)),
                                  __int_as_float(SCALE_CEIL_BITS));
        for (long long k = start + lane; k < end; k += WARP) {
            const float q = rintf(__fdiv_rn(x[k], scale));
            codes[k] = (signed char)fminf(fmaxf(q, -127.0f), 127.0f);
        }
        if (lane == 0) scales[b] = scale;
    }
}

extern "C" __global__ void dequantize_blocks(const signed char* __restrict__ codes,
                                             const float* __restrict__ scales,
                                             float* __restrict__ out,
                                             long long n, int block, long long nblocks) {
    const int lane = threadIdx.x % WARP;
    const long long first_warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) / WARP;
    for (long long b = first_warp; b < nblocks; b += nwarps) {
        const long long start = b * block;
        const long long end = start + block < n ? start + block : n;
        const float scale = scales[b];
        for (long long k = start + lane; k < end; k += WARP)
            out[k] = __fmul_rn((float)codes[k], scale);
    }
}
