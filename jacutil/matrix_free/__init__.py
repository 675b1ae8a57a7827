"""Products with the Jacobian without forming it, and forward mode (09-matrix-free).

- ``products``  ``jvp``, ``vjp``, ``products``, ``jacobian_operator``
- ``forward``      ``forward_jacobian``: J column block by column block
"""

from ..core.lazy import lazy_modules

__getattr__ = lazy_modules(__name__, {"forward", "products"})
