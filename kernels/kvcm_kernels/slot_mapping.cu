// Slot mapping of a batch for every layer group (blockIdx.y): out[g, i] for token i is
// slot * tpb + position % tpb, with slot = table[g, rows[j], position / tpb] for the request j
// whose tokens [qsl[j], qsl[j + 1]) hold i; -1 for no page (slot < min_live: 0, or 1 with the
// null page) and for padding (i >= qsl[n]).
extern "C" __global__ void slot_mapping(const int* __restrict__ tables,
                                        const long long* __restrict__ rows,
                                        const long long* __restrict__ qsl,
                                        const long long* __restrict__ positions,
                                        long long* __restrict__ out, int n, int pad_to,
                                        int table_rows, int cols, int tpb, int min_live) {
  const int* table = tables + (long long)blockIdx.y * table_rows * cols;
  long long* dst = out + (long long)blockIdx.y * pad_to;
  const long long total = qsl[n];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pad_to; i += gridDim.x * blockDim.x) {
    long long v = -1;
    if (i < total) {
      int lo = 0, hi = n - 1;  // the last j with qsl[j] <= i (empty requests are skipped)
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const long long p = positions[i];
      const int s = table[rows[lo] * cols + p / tpb];
      v = s >= min_live ? (long long)s * tpb + p % tpb : -1;
    }
    dst[i] = v;
  }
}
