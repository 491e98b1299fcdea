// Block-wise int8 quantisation of a flat fp32 tensor, bit-identical to modules/quant/codec.py.
//
// Rounding rules (shared with the CPU path; every operation IEEE fp32, round to nearest even):
//   absmax = max |x| over the block                        (exact)
//   scale  = min(max(absmax / 127, 2^-126), SCALE_CEIL)    (div.rn.f32; floor = FLT_MIN: never 0
//                                                           or denormal; ceiling: 127 * scale
//                                                           stays finite)
//   code   = clamp(rint(x / scale), -127, 127)             (div.rn.f32, cvt.rni: half to even)
//   x'     = (float)code * scale                           (mul.rn.f32: no FMA contraction)
// Independent of -ftz: cupy compiles every RawModule with -ftz=true, which turns fabsf, fmaxf,
// __fdiv_rn, rintf, (int) and __fmul_rn into their .ftz forms (denormal inputs and results flushed to
// 0, e.g. a denormal x then gives code 0 where the CPU gives 1). So |x| and the block max are
// integer operations on the bits, and every float operation is written as PTX without .ftz
// (inline asm is not rewritten by the flag). tests/test_gpu_seams.py compiles this file with
// cupy's options and checks the PTX holds no .ftz instruction.
//
// One warp per quantisation block: the lanes stride over the block (coalesced loads), reduce the
// absmax with shuffles, then quantise; the second read of the block hits L1/L2, so DRAM traffic
// is 4 bytes in + 1 byte out (+ 4 per block) per element. The same pass counts NaN/inf values,
// so detecting them costs no extra read of the input. Only builtins and intrinsics are used
// (no headers), so NVRTC (cupy.RawModule) and nvcc compile the same source.
//
// mark != 0 (the pipeline's per-row messages, modules/quant/rows.py): NaN/inf values count as 0
// and their block's scale is NaN, written on the GPU: no count to read back, no host sync.

#define WARP 32
#define FULL_MASK 0xffffffffu
#define ABS_MASK 0x7fffffffu
#define INF_BITS 0x7f800000u         // |x| bits >= this: inf or NaN
#define SCALE_FLOOR_BITS 0x00800000  // 2^-126 = FLT_MIN
#define SCALE_CEIL_BITS 0x7c010203   // 2.6793884e36: largest s with 127 * s < inf
#define NAN_BITS 0x7fc00000

__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// round half to even straight to an int (the x / scale of a code fits: |q| <= 127 + 1 ulp)
__device__ __forceinline__ int rint_to_int(float a) {
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ unsigned int umax(unsigned int a, unsigned int b) {
    return a > b ? a : b;
}

// |x| bits of a finite value, 0 for NaN/inf (they are reported or marked, never used)
__device__ __forceinline__ unsigned int finite_abs_bits(float v) {
    const unsigned int a = __float_as_uint(v) & ABS_MASK;
    return a < INF_BITS ? a : 0u;
}

// the code of x under `scale` (a normal float): an integer in -127..127
__device__ __forceinline__ signed char code_of(float x, float scale) {
    const int c = rint_to_int(div_rn(x, scale));
    return (signed char)(c < -127 ? -127 : (c > 127 ? 127 : c));
}

extern "C" __global__ void quantize_blocks(const float* __restrict__ x,
                                           signed char* __restrict__ codes,
                                           float* __restrict__ scales,
                                           unsigned long long* __restrict__ nonfinite,
                                           long long n, int block, long long nblocks,
                                           int mark) {
    const int lane = threadIdx.x % WARP;
    const long long first_warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) / WARP;
    for (long long b = first_warp; b < nblocks; b += nwarps) {  // uniform across the warp
        const long long start = b * block;
        const long long end = start + block < n ? start + block : n;
        unsigned int m = 0u;  // absmax bits: non-negative floats order as their bits
        unsigned int bad = 0;
        for (long long k = start + lane; k < end; k += WARP) {
            const float v = x[k];
            bad += (__float_as_uint(v) & ABS_MASK) < INF_BITS ? 0u : 1u;
            m = umax(m, finite_abs_bits(v));
        }
        for (int off = WARP / 2; off > 0; off >>= 1) {
            m = umax(m, __shfl_xor_sync(FULL_MASK, m, off));
            bad += __shfl_xor_sync(FULL_MASK, bad, off);
        }
        if (lane == 0 && bad && !mark) atomicAdd(nonfinite, (unsigned long long)bad);
        // absmax / 127 >= 0: the floor and ceiling are integer comparisons of the bits too
        unsigned int s = __float_as_uint(div_rn(__uint_as_float(m), 127.0f));
        s = s < SCALE_FLOOR_BITS ? SCALE_FLOOR_BITS : (s > SCALE_CEIL_BITS ? SCALE_CEIL_BITS : s);
        const float scale = __uint_as_float(s);
        for (long long k = start + lane; k < end; k += WARP) {
            const float v = x[k];
            const bool finite = (__float_as_uint(v) & ABS_MASK) < INF_BITS;
            codes[k] = finite ? code_of(v, scale) : (mark ? (signed char)0 : (signed char)127);
        }
        if (lane == 0) scales[b] = (mark && bad) ? __uint_as_float(NAN_BITS) : scale;
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
            out[k] = mul_rn((float)codes[k], scale);
    }
}
