// Apply (layer group, row, block position, slot) edits to the page tables of all layer groups.
// tables: int32 [groups, rows, cols]; edits: int4 [num_edits], each cell at most once.
extern "C" __global__ void apply_page_table_edits(int* __restrict__ tables,
                                                  const int4* __restrict__ edits,
                                                  int num_edits, int rows, int cols) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_edits;
       i += gridDim.x * blockDim.x) {
    const int4 e = edits[i];
    tables[((long long)e.x * rows + e.y) * cols + e.z] = e.w;
  }
}
