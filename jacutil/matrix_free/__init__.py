"""Products with the Jacobian without forming it, and forward mode (09-matrix-free).

- ``products``  ``jvp``, ``vjp``, ``products``, ``jacobian_operator``
- ``forward``      ``forward_jacobian``: J column block by column block
"""

from ..core.lazy import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, modules="forward products")
