// Per-layer pointer table: out[l, r] = pointer_table[pool, page_role[r]] + page_offset *
// page_bytes[pool] for (pool, page_offset) = pool_map[l, r]; 0 where the layer has no such role
// (pool -1). page_role[r] is the column of role r in its page (1 for value and value_scale).
extern "C" __global__ void layer_pointers(const long long* __restrict__ pointer_table,
                                          const int2* __restrict__ pool_map,
                                          const long long* __restrict__ page_bytes,
                                          const int* __restrict__ page_role,
                                          long long* __restrict__ out, int n, int num_roles) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int2 m = pool_map[i];
    out[i] = m.x >= 0 ? pointer_table[2 * m.x + page_role[i % num_roles]] +
                            (long long)m.y * page_bytes[m.x]
                      : 0;
  }
}
