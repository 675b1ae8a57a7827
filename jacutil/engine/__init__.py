"""The engine: the one compiled machinery every entry runs on.

- ``autodiff``  the autodiff formulations of the per-sample Jacobian
- ``compiled``  ``compiled_for``: one compiled Jacobian per model, variables
                and options (the rules' checked plan, or the fallback ladder)
- ``rows``      the Jacobian's rows in the planner's chunks
- ``choice``    which path a call took, and why (``explain=True``)
- ``jacobian``  the path choice of ``jacutil.jacobian``

Layering (``../shared/DESIGN.md``): core <- rules <- engine <- the consumers
(stages, matrix_free, curvature, fitting, privacy, scale, auto).
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(
    __name__, modules="autodiff choice compiled jacobian rows"
)
