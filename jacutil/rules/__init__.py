"""Layer rules: each known layer writes its own blocks of the Jacobian.

``plan_for(model, variables)`` gives each layer of a Keras chain its rule
(``RULES``, by exact layer type): Dense, Conv1D/Conv2D, Embedding,
LayerNormalization, BatchNormalization and Dropout in inference mode,
Flatten/Reshape, activation layers, and LSTM, GRU and SimpleRNN
(back-propagation through time). A layer without a rule (pooling, a custom layer)
passes the signal by autodiff, and only its own blocks come from autodiff.

``rules_tensor(plan, x)`` is the Jacobian; its compiled, cached form is
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
    plan_for,
    rules_tensor,
)
from .registry import RULES, NoRule, Rule, register, rule_for

__all__ = [
    "RULES",
    "AutodiffRule",
    "NoRule",
    "Node",
    "Plan",
    "Rule",
    "chain_layers",
    "chain_nodes",
    "disagreement",
    "is_exact_keras",
    "plan_for",
    "register",
    "rule_for",
    "rules_tensor",
    "tiled_vjp",
]
