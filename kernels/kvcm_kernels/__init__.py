"""Index and copy kernels of kvcm.

Each kernel family is one module: a CUDA C source (``.cu``, loaded by ``cupy.RawModule``), the
torch reference with the same signature (the CPU path and the oracle in tests), and the public
function that dispatches between them (``_dispatch.gpu_path``). CuPy is optional: without it,
or for CPU tensors, the reference runs.
"""

from ._dispatch import current_stream_handle
from .block_copy import copy_segments, copy_segments_reference, pieces, segments
from .kv_copy import TokenCopyPool, copy_tokens
from .page_indices import kernel_page_indices
from .page_table_edits import apply_page_table_edits
from .pointers import layer_pointers
from .ragged_pages import ragged_page_indices
from .slot_mapping import slot_mapping, slot_mapping_host
from .step_tables import apply_edits_and_map_slots

__all__ = [
    "TokenCopyPool",
    "apply_edits_and_map_slots",
    "apply_page_table_edits",
    "copy_segments",
    "copy_segments_reference",
    "copy_tokens",
    "current_stream_handle",
    "kernel_page_indices",
    "layer_pointers",
    "pieces",
    "ragged_page_indices",
    "segments",
    "slot_mapping",
    "slot_mapping_host",
]
