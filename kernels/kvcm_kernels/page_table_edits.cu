// Apply (layer group, row, block position, slot) edits to the page tables of all layer groups.
// tables: int32 [groups, rows, cols]; edits: int64 [num_edits, 4], each cell at most once.
extern "C" __global__ void apply_page_table_edits(int* __restrict__ tables,
                                                  const long long* __restrict__ edits,
                                                  int num_edits, int rows, int cols) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_edits;
       i += gridDim.x * blockDim.x) {
    const long long* e = edits + 4 * (long long)i;
    tables[(e[0] * rows + e[1]) * cols + e[2]] = (int)e[3];
  }
}
