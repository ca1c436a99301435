// Copy one token's entries of a run of buffers of a pool, for each (row, src, dst) op
// (blockIdx.x) and each descriptor (blockIdx.y). A descriptor is 8 int64: layer group, address
// of its first buffer in slot 0, slot bytes, bytes per buffer, buffers, token bytes, width (the
// widest of 16/8/4/2/1 bytes dividing token bytes), offset of its tokens in an op's scratch row.
//
// mode 0 (direct) copies pool to pool: only safe when no destination is another op's source.
// mode 1 (gather) copies the sources to scratch row op, mode 2 (scatter) that row to the
// destinations: launched one after the other on one stream, every read precedes every write.
// Scratch row op holds the descriptor's buffers back to back: buffer j at offset + j * token
// bytes (offsets are multiples of 16 and so is the row stride, so every width stays aligned).
template <typename T>
__device__ void copy_units(char* dst, long long dst_step, const char* src, long long src_step,
                           long long nbuf, long long units) {
  const long long total = nbuf * units;
  for (long long u = threadIdx.x; u < total; u += blockDim.x) {
    const long long j = u / units;
    const long long byte = (u - j * units) * (long long)sizeof(T);
    *reinterpret_cast<T*>(dst + j * dst_step + byte) =
        *reinterpret_cast<const T*>(src + j * src_step + byte);
  }
}

extern "C" __global__ void copy_tokens(const int* __restrict__ tables,
                                       const long long* __restrict__ ops,
                                       const long long* __restrict__ desc, int table_rows,
                                       int cols, int tpb, char* scratch,
                                       long long scratch_stride, int mode, int min_live) {
  const long long* d = desc + 8 * blockIdx.y;
  const long long* op = ops + 3 * (long long)blockIdx.x;
  const int* row = tables + (d[0] * table_rows + op[0]) * cols;
  const int src_slot = row[op[1] / tpb];
  const int dst_slot = row[op[2] / tpb];
  // No page (-1, or the null page 0 when min_live is 1): the same ops skip in every mode.
  if (src_slot < min_live || dst_slot < min_live) return;
  char* base = reinterpret_cast<char*>(d[1]);
  const long long slot_bytes = d[2], bpb = d[3], nbuf = d[4], token_bytes = d[5], width = d[6];
  const char* src = base + src_slot * slot_bytes + (op[1] % tpb) * token_bytes;
  char* dst = base + dst_slot * slot_bytes + (op[2] % tpb) * token_bytes;
  long long src_step = bpb, dst_step = bpb;
  if (mode == 1) {
    dst = scratch + blockIdx.x * scratch_stride + d[7];
    dst_step = token_bytes;
  } else if (mode == 2) {
    src = scratch + blockIdx.x * scratch_stride + d[7];
    src_step = token_bytes;
  }
  const long long units = token_bytes / width;
  switch (width) {
    case 16: copy_units<int4>(dst, dst_step, src, src_step, nbuf, units); break;
    case 8: copy_units<long long>(dst, dst_step, src, src_step, nbuf, units); break;
    case 4: copy_units<int>(dst, dst_step, src, src_step, nbuf, units); break;
    case 2: copy_units<short>(dst, dst_step, src, src_step, nbuf, units); break;
    default: copy_units<char>(dst, dst_step, src, src_step, nbuf, units); break;
  }
}
