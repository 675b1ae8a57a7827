"""Layer rules: each known layer writes its own blocks of the Jacobian.

``plan_for(model, variables)`` gives each layer of a Keras chain its rule
(``RULES``, by exact layer type): Dense, Conv1D/Conv2D, Embedding,
LayerNormalization, BatchNormalization and Dropout in inference mode,
Flatten/Reshape, activation layers, and LSTM, GRU and SimpleRNN
(back-propagation through time). A layer without a rule (pooling, a custom layer)
passes the signal by autodiff, and only its own blocks come from autodiff.

A rule subclasses :class:`Rule` (``_forward``, ``_backward``; the final
``forward``/``backward`` check its shapes), registers with ``@register(T)``
(or for a while: ``with registered(T, RuleClass):``), and is proved alone
against autodiff by ``jacutil.testing.check_rule``.

``rules_tensor(plan, x)`` is the Jacobian (``rules_squared_norms`` the
per-sample norms of ``J_i.T s_i``, without it where a rule knows how); its compiled, cached form is
``compiled_jacobian(model, method="rules")``, and ``jacutil.jacobian`` picks
it when it applies. Introduced in ``07-benchmark``.
"""

from . import conv, dense, embedding, normalization, recurrent, shape  # noqa: F401
from .autodiff import AutodiffRule, tiled_vjp
from .engine import (
    Node,
    Plan,
    chain_layers,
    chain_nodes,
    disagreement,
    is_exact_keras,
    place_blocks,
    plan_for,
    rules_squared_norms,
    rules_tensor,
)
from .registry import (
    RULES,
    AlreadyRegistered,
    Blocks,
    LogitsSignal,
    NoRule,
    Rule,
    RuleContractError,
    Wanted,
    register,
    registered,
    rule_for,
)

__all__ = [
    "RULES",
    "AlreadyRegistered",
    "AutodiffRule",
    "Blocks",
    "LogitsSignal",
    "NoRule",
    "Node",
    "Plan",
    "Rule",
    "RuleContractError",
    "Wanted",
    "chain_layers",
    "chain_nodes",
    "disagreement",
    "is_exact_keras",
    "place_blocks",
    "plan_for",
    "register",
    "registered",
    "rule_for",
    "rules_squared_norms",
    "rules_tensor",
    "tiled_vjp",
]
