"""The four stages, one notebook and one function each.

- ``loop``        ``loop_jacobian``: the nested loop of the question (01-nested-loop)
- ``vectorized``  ``vectorized_jacobian``: one tape, pfor (02-vectorized)
- ``compiled``    ``compiled_jacobian``: a tf.function, traced once (03-compiled)
- ``chunked``     ``chunked_jacobian``: memory-bounded chunks (04-chunked)
- ``dense``       ``dense_jacobian``: the layer rules, Dense only (07-benchmark)

A stage is a lesson: the engine (``jacutil.engine``) runs the code it shows,
and no other part of the package imports a stage.
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__, modules="chunked compiled dense loop vectorized"
)
