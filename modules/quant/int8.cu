// Block-wise int8 quantisation of a flat fp32 tensor, bit-identical to modules/quant/codec.py.
//
// Rounding rules (shared with the CPU path):
//   absmax = max |x| over the block (fp32)
//   scale  = absmax / 127.0f                 (IEEE fp32 division)
//   inv    = absmax > 0 ? 127.0f / absmax : 0 (IEEE fp32 division)
//   code   = clamp(rint(x * inv), -127, 127) (fp32 multiply, round half to even)
//   x'     = (float)code * scale
// No fused multiply-add may touch these expressions (__fmul_rn forbids contraction).

extern "C" __global__ void block_absmax(const float* __restrict__ x, float* __restrict__ scales,
                                        long long n, int block) {
    extern __shared__ float partial[];
    long long start = (long long)blockIdx.x * block;
    float m = 0.0f;
    for (int i = threadIdx.x; i < block; i += blockDim.x) {
        long long k = start + i;
        if (k < n) m = fmaxf(m, fabsf(x[k]));
    }
    partial[threadIdx.x] = m;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride)
            partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
        __syncthreads();
    }
    if (threadIdx.x == 0) scales[blockIdx.x] = partial[0];  // absmax; turned into scale below
}

extern "C" __global__ void quantize(const float* __restrict__ x,
                                    const float* __restrict__ absmax,
                                    signed char* __restrict__ codes,
                                    float* __restrict__ scales, long long n, int block) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    long long b = k / block;
    float a = absmax[b];
    float inv = a > 0.0f ? __fdiv_rn(127.0f, a) : 0.0f;
    float q = rintf(__fmul_rn(x[k], inv));
    q = fminf(fmaxf(q, -127.0f), 127.0f);
    codes[k] = (signed char)q;
    if (k % block == 0) scales[b] = __fdiv_rn(a, 127.0f);
}

extern "C" __global__ void dequantize(const signed char* __restrict__ codes,
                                      const float* __restrict__ scales,
                                      float* __restrict__ out, long long n, int block) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n) return;
    out[k] = __fmul_rn((float)codes[k], scales[k / block]);
}
