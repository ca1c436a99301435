// One scheduler step's device work in one launch of one thread block: apply the step's page-
// table edits, then map the batch's new tokens to slots for layer groups [first_group,
// first_group + num_groups). __syncthreads orders the edits before the reads: within a block,
// global writes before the barrier are visible to every thread after it. The tables are read
// through a plain pointer (no read-only cache), since this kernel writes them. The inputs may
// live in pinned host memory (read over the bus); qsl is staged in shared memory when it fits
// (staged != 0) so the binary search does not pay a bus round trip per step. A slot below
// min_live is no page (-1 in the mapping): 0 normally, 1 with the null page.
extern "C" __global__ void apply_edits_and_map_slots(
    int* tables, const long long* __restrict__ edits, int num_edits,
    const long long* __restrict__ rows, const long long* __restrict__ qsl_in,
    const long long* __restrict__ positions, long long* __restrict__ out, int n, int pad_to,
    int first_group, int num_groups, int table_rows, int cols, int tpb, int min_live,
    int staged) {
  extern __shared__ long long shared_qsl[];
  const long long* qsl = qsl_in;
  if (staged) {
    for (int j = threadIdx.x; j <= n; j += blockDim.x) shared_qsl[j] = qsl_in[j];
    qsl = shared_qsl;
  }
  for (int i = threadIdx.x; i < num_edits; i += blockDim.x) {
    const long long* e = edits + 4 * (long long)i;
    tables[(e[0] * table_rows + e[1]) * cols + e[2]] = (int)e[3];
  }
  __syncthreads();
  const long long total = qsl[n];
  for (int k = threadIdx.x; k < num_groups * pad_to; k += blockDim.x) {
    const int g = k / pad_to;
    const int i = k - g * pad_to;
    long long v = -1;
    if (i < total) {
      int lo = 0, hi = n - 1;  // the last j with qsl[j] <= i
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const long long p = positions[i];
      const int* table = tables + (long long)(first_group + g) * table_rows * cols;
      const int s = table[rows[lo] * cols + p / tpb];
      v = s >= min_live ? (long long)s * tpb + p % tpb : -1;
    }
    out[k] = v;
  }
}
