// Ragged (CSR) kernel-mode page indices, FlashInfer's paged-KV layout, in one launch.
//
// Request i (page-table row rows[i], lengths[i] tokens) lists the entries j < cols of its row
// whose slot is live (>= min_live) and whose global block j * cp + rank holds one of its tokens
// (block < ceil(length / tokens_per_block)), in order, as slot * multiplier + offset.
//
// ragged_page_indices (one block of 1024 threads, 32 warps) counts and scans itself. One warp
// per request: requests go in rounds of 32. In a round each warp counts its request's
// entries, 32 at a time with a ballot (and finds its last page, its first page past the sinks
// and its sink pages), warp 0 scans the round's 32 counts on top of the carry of the rounds
// before, and each warp writes its pages: a lane's place is the live lanes below it in the
// ballot. Writes past ``capacity`` (the caller's size of ``indices``) are dropped.
#define WARPS 32
#define FULL 0xffffffffu

extern "C" __global__ void ragged_page_indices(
    const int* __restrict__ table, const long long* __restrict__ rows,
    const long long* __restrict__ lengths, int n, int cols, int tokens_per_block, int cp,
    int rank, int sink_blocks, int min_live, int multiplier, int offset, int capacity,
    int* __restrict__ indptr, int* __restrict__ indices, int* __restrict__ last_page_len,
    int* __restrict__ first_token, int* __restrict__ num_sink_pages) {
  __shared__ int starts[WARPS];
  __shared__ int carry;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;  // the lanes before this one
  if (threadIdx.x == 0) {
    carry = 0;
    indptr[0] = 0;
  }
  for (int base = 0; base < n; base += WARPS) {
    const int i = base + warp;  // the same in every lane of a warp: no divergence below
    const int* src = table;
    int width = 0;  // this row's entries whose block holds a token
    int count = 0;
    if (i < n) {
      src = table + rows[i] * (long long)cols;
      const long long length = lengths[i];
      const long long blocks = (length + tokens_per_block - 1) / tokens_per_block;
      const long long local = (blocks - rank + cp - 1) / cp;  // >= 0: rank < cp
      width = (int)(local < cols ? local : cols);
      int last = -1, first = -1, sinks = 0;
      for (int j0 = 0; j0 < width; j0 += 32) {
        const int j = j0 + lane;
        const bool live = j < width && src[j] >= min_live;
        const bool window = live && (long long)j * cp + rank >= sink_blocks;
        const unsigned mask = __ballot_sync(FULL, live);
        const unsigned late = __ballot_sync(FULL, window);
        count += __popc(mask);
        sinks += __popc(mask & ~late);
        if (mask) last = j0 + 31 - __clz(mask);
        if (first < 0 && late) first = j0 + __ffs(late) - 1;
      }
      if (lane == 0) {
        long long tail = 0;
        if (last >= 0) {
          tail = length - ((long long)last * cp + rank) * tokens_per_block;
          tail = tail < tokens_per_block ? tail : tokens_per_block;
        }
        last_page_len[i] = (int)tail;
        first_token[i] = first < 0 ? 0 : (int)(((long long)first * cp + rank) * tokens_per_block);
        num_sink_pages[i] = sinks;
      }
    }
    if (lane == 0) starts[warp] = count;
    __syncthreads();
    if (warp == 0) {
      const int own = starts[lane];
      int inclusive = own;
      for (int d = 1; d < 32; d <<= 1) {
        const int up = __shfl_up_sync(FULL, inclusive, d);
        if (lane >= d) inclusive += up;
      }
      const int before = carry;
      starts[lane] = before + inclusive - own;
      if (base + lane < n) indptr[base + lane + 1] = before + inclusive;
      __syncwarp();
      if (lane == 31) carry = before + inclusive;
    }
    __syncthreads();
    if (i < n) {
      int at = starts[warp];
      for (int j0 = 0; j0 < width; j0 += 32) {
        const int j = j0 + lane;
        const int slot = j < width ? src[j] : -1;
        const bool live = j < width && slot >= min_live;
        const unsigned mask = __ballot_sync(FULL, live);
        const int k = at + __popc(mask & below);
        if (live && k < capacity) indices[k] = slot * multiplier + offset;
        at += __popc(mask);
      }
    }
    __syncthreads();  // the next round rewrites starts
  }
}

// The same with the caller's indptr (int64, from its bookkeeping): no scan, so any number of
// blocks, one warp per request and WARPS_PLACED warps a block, one pass over the row. Request
// i's pages go to [indptr[i], indptr[i + 1]) and nowhere else (a row that lists more than its
// range drops the rest). The int32 indptr output is the input's copy.
#define WARPS_PLACED 8

extern "C" __global__ void ragged_page_indices_placed(
    const int* __restrict__ table, const long long* __restrict__ rows,
    const long long* __restrict__ lengths, const long long* __restrict__ indptr_in, int n,
    int cols, int tokens_per_block, int cp, int rank, int sink_blocks, int min_live,
    int multiplier, int offset, int* __restrict__ indptr, int* __restrict__ indices,
    int* __restrict__ last_page_len, int* __restrict__ first_token,
    int* __restrict__ num_sink_pages) {
  const int lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  if (blockIdx.x == 0 && threadIdx.x == 0) indptr[0] = 0;
  const int stride = gridDim.x * WARPS_PLACED;
  for (int i = blockIdx.x * WARPS_PLACED + (threadIdx.x >> 5); i < n; i += stride) {
    const int* src = table + rows[i] * (long long)cols;
    const long long length = lengths[i];
    const long long blocks = (length + tokens_per_block - 1) / tokens_per_block;
    const long long local = (blocks - rank + cp - 1) / cp;
    const int width = (int)(local < cols ? local : cols);
    const long long end = indptr_in[i + 1];
    long long at = indptr_in[i];
    int last = -1, first = -1, sinks = 0;
    for (int j0 = 0; j0 < width; j0 += 32) {
      const int j = j0 + lane;
      const int slot = j < width ? src[j] : -1;
      const bool live = j < width && slot >= min_live;
      const bool window = live && (long long)j * cp + rank >= sink_blocks;
      const unsigned mask = __ballot_sync(FULL, live);
      const unsigned late = __ballot_sync(FULL, window);
      const long long k = at + __popc(mask & below);
      if (live && k < end) indices[k] = slot * multiplier + offset;
      at += __popc(mask);
      sinks += __popc(mask & ~late);
      if (mask) last = j0 + 31 - __clz(mask);
      if (first < 0 && late) first = j0 + __ffs(late) - 1;
    }
    if (lane == 0) {
      long long tail = 0;
      if (last >= 0) {
        tail = length - ((long long)last * cp + rank) * tokens_per_block;
        tail = tail < tokens_per_block ? tail : tokens_per_block;
      }
      indptr[i + 1] = (int)end;
      last_page_len[i] = (int)tail;
      first_token[i] = first < 0 ? 0 : (int)(((long long)first * cp + rank) * tokens_per_block);
      num_sink_pages[i] = sinks;
    }
  }
}
