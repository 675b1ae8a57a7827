"""What every path shares.

- ``target``       what is differentiated: a model or callable, its variables
- ``batch``        the input: checked, cast, split, keyed by shape
- ``outputs``      the layout of the outputs (several, nested)
- ``layout``       flat parameters, (n, l, m) <-> (l * m, n)
- ``memory``       peak-memory measurement and the memory model
- ``planner``      budget -> chunk size -> chunks -> output, checked once
- ``resume``       the file and ledger that let a killed run resume
- ``cache``        one compiled Jacobian per model, owned weakly
- ``graph_calls``  a repeated ``tf.function`` call without its per-call lookup
- ``guards``       the checks that turn the classic mistakes into errors
- ``formulation``  which formulation traces: pfor, map_fn, XLA, and their logs
- ``second_order`` ``ensure_second_order``: gradients of gradient ops TF lacks

Internal: ``_tf`` (the TensorFlow import), ``_grouped`` (a fix for a
TensorFlow gap), ``_shared`` (small helpers used everywhere),
``lazy`` (what a package imports on first use).
"""

from .lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__,
    modules="batch cache formulation graph_calls guards layout memory outputs "
    "planner resume second_order target",
)
