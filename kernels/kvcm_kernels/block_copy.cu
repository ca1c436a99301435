// Copy byte segments: segment i copies desc[3i + 2] bytes from address desc[3i] to address
// desc[3i + 1]. Addresses may be device memory or pinned host memory (unified addressing: the
// host tier's regions are read and written in place, no staging). One block per segment at a
// time (grid-stride over segments); 16-byte units when both addresses and the size are
// multiples of 16 (every pool slot is), four units in flight per thread, bytes otherwise.
extern "C" __global__ void copy_segments(const long long* __restrict__ desc, long long count) {
  __shared__ long long seg[3];
  for (long long i = blockIdx.x; i < count; i += gridDim.x) {
    if (threadIdx.x < 3) seg[threadIdx.x] = desc[3 * i + threadIdx.x];
    __syncthreads();
    const char* src = reinterpret_cast<const char*>(seg[0]);
    char* dst = reinterpret_cast<char*>(seg[1]);
    const long long n = seg[2];
    if (((seg[0] | seg[1] | n) & 15) == 0) {
      const int4* s = reinterpret_cast<const int4*>(src);
      int4* d = reinterpret_cast<int4*>(dst);
      const long long units = n >> 4, step = blockDim.x;
      long long u = threadIdx.x;
      for (; u + 3 * step < units; u += 4 * step) {
        const int4 a = s[u], b = s[u + step], c = s[u + 2 * step], e = s[u + 3 * step];
        d[u] = a;
        d[u + step] = b;
        d[u + 2 * step] = c;
        d[u + 3 * step] = e;
      }
      for (; u < units; u += step) d[u] = s[u];
    } else {
      for (long long b = threadIdx.x; b < n; b += blockDim.x) dst[b] = src[b];
    }
    __syncthreads();
  }
}
