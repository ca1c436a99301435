"""Index kernels of kvcm: page indices and slot mappings.

Each kernel family has a torch reference (this package's CPU path and the oracle in tests).
The manager calls only the names exported here, so a GPU implementation plugs in behind them
without the manager changing.
"""

from .page_indices import kernel_page_indices
from .slot_mapping import slot_mapping

__all__ = ["kernel_page_indices", "slot_mapping"]
