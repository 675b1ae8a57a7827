"""Stage 4: slices of the batch through the compiled Jacobian (notebook 04-chunked).

The lesson is the engine's own chunked rows, shown as they run.
"""

from ..engine.rows import chunked_jacobian

__all__ = ["chunked_jacobian"]
