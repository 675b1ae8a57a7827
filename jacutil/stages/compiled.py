"""Stage 3: the Jacobian compiled with tf.function and XLA (notebook 03-compiled).

The lesson is the engine's own compiled Jacobian, shown as it runs.
"""

from ..engine.compiled import CompiledJacobian, compiled_jacobian

__all__ = ["CompiledJacobian", "compiled_jacobian"]
