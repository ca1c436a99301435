// Copy one token's entries of every buffer of a pool, for each (row, src, dst) op (blockIdx.x)
// and each (layer group, pool) descriptor (blockIdx.y). A descriptor is 7 int64:
// layer group, pool base address, slot bytes, bytes per buffer, buffers, token bytes, width
// (the widest of 16/8/4/2/1 bytes dividing token bytes). Sources and destinations are disjoint.
// An op whose source or destination slot is below min_live (no page: -1, or the null page 0)
// is skipped.
template <typename T>
__device__ void copy_units(char* dst, const char* src, long long nbuf, long long bpb,
                           long long units) {
  const long long total = nbuf * units;
  for (long long u = threadIdx.x; u < total; u += blockDim.x) {
    const long long j = u / units;
    const long long off = j * bpb + (u - j * units) * (long long)sizeof(T);
    *reinterpret_cast<T*>(dst + off) = *reinterpret_cast<const T*>(src + off);
  }
}

extern "C" __global__ void copy_tokens(const int* __restrict__ tables,
                                       const long long* __restrict__ ops,
                                       const long long* __restrict__ desc, int table_rows,
                                       int cols, int tpb, int min_live) {
  const long long* d = desc + 7 * blockIdx.y;
  const long long* op = ops + 3 * (long long)blockIdx.x;
  const int* row = tables + (d[0] * table_rows + op[0]) * cols;
  const int src_slot = row[op[1] / tpb];
  const int dst_slot = row[op[2] / tpb];
  if (src_slot < min_live || dst_slot < min_live) return;
  char* base = reinterpret_cast<char*>(d[1]);
  const long long slot_bytes = d[2], bpb = d[3], nbuf = d[4], token_bytes = d[5], width = d[6];
  const char* src = base + src_slot * slot_bytes + (op[1] % tpb) * token_bytes;
  char* dst = base + dst_slot * slot_bytes + (op[2] % tpb) * token_bytes;
  const long long units = token_bytes / width;
  switch (width) {
    case 16: copy_units<int4>(dst, src, nbuf, bpb, units); break;
    case 8: copy_units<long long>(dst, src, nbuf, bpb, units); break;
    case 4: copy_units<int>(dst, src, nbuf, bpb, units); break;
    case 2: copy_units<short>(dst, src, nbuf, bpb, units); break;
    default: copy_units<char>(dst, src, nbuf, bpb, units); break;
  }
}
