// Kernel-mode page indices: out[i, c] = table[rows[i], c] * multiplier + offset, -1 kept.
extern "C" __global__ void kernel_page_indices(const int* __restrict__ table,
                                               const long long* __restrict__ rows,
                                               int* __restrict__ out, int n, int cols,
                                               int multiplier, int offset) {
  for (int r = blockIdx.y; r < n; r += gridDim.y) {
    const int* src = table + rows[r] * cols;
    int* dst = out + (long long)r * cols;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
      const int v = src[c];
      dst[c] = v >= 0 ? v * multiplier + offset : -1;
    }
  }
}

// The same, four entries per thread (cols divisible by 4, 16-byte aligned rows).
extern "C" __global__ void kernel_page_indices_vec4(const int4* __restrict__ table,
                                                    const long long* __restrict__ rows,
                                                    int4* __restrict__ out, int n, int cols4,
                                                    int multiplier, int offset) {
  for (int r = blockIdx.y; r < n; r += gridDim.y) {
    const int4* src = table + rows[r] * cols4;
    int4* dst = out + (long long)r * cols4;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols4; c += gridDim.x * blockDim.x) {
      int4 v = src[c];
      v.x = v.x >= 0 ? v.x * multiplier + offset : -1;
      v.y = v.y >= 0 ? v.y * multiplier + offset : -1;
      v.z = v.z >= 0 ? v.z * multiplier + offset : -1;
      v.w = v.w >= 0 ? v.w * multiplier + offset : -1;
      dst[c] = v;
    }
  }
}
