"""Layer rules: each known layer writes its own blocks of the Jacobian.

``plan_for(model, variables)`` gives each layer of a Keras model its rule
(``RULES``, by exact layer type): Dense, Conv1D/Conv2D (grouped too),
DepthwiseConv1D/2D, EinsumDense and MultiHeadAttention, LoRA on Dense,
EinsumDense and Embedding, Embedding, LayerNormalization, RMSNormalization,
BatchNormalization and Dropout in inference mode, Flatten/Reshape,
padding, cropping, up-sampling and pooling, activation layers, and LSTM,
GRU and SimpleRNN (back-propagation through time). A layer without a rule
(a custom layer) passes the signal by autodiff, and only its own blocks
come from autodiff.
A functional model with branches (residual blocks, several inputs or heads,
nested models) is a graph: its merge layers (``Add``, ``Concatenate``,
``Multiply``, ...) have rules of several inputs (``MERGE_RULES``, in
``jacutil.rules.merge``), and the signals of a tensor read twice are summed.

A rule subclasses :class:`Rule` (``_forward``, ``_backward``; the final
``forward``/``backward`` check its shapes), registers with ``@register(T)``
(or for a while: ``with registered(T, RuleClass):``), and is proved alone
against autodiff by ``jacutil.testing.check_rule``.

``rules_tensor(plan, x)`` is the Jacobian (``rules_squared_norms`` the
per-sample norms of ``J_i.T s_i``, without it where a rule knows how); its
compiled, cached form is ``compiled_jacobian(model, method="rules")``, and
``jacutil.jacobian`` picks it when it applies. Introduced in ``07-benchmark``.
"""

from . import (  # noqa: F401
    attention,
    conv,
    dense,
    einsum_dense,
    embedding,
    merge,
    normalization,
    pooling,
    recurrent,
    separable,
    shape,
)
from .autodiff import AutodiffRule, tiled_vjp, tiled_vjps
from .graph import Node, Wiring, chain_layers, chain_nodes, graph_nodes, is_exact_keras
from .merge import MERGE_RULES, MergeRule
from .plan import Plan, plan_for
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
from .verify import disagreement
from .walk import (
    OutputRows,
    SignalOnSeveralOutputs,
    place_blocks,
    rules_squared_norms,
    rules_tensor,
)

__all__ = [
    "MERGE_RULES",
    "RULES",
    "AlreadyRegistered",
    "AutodiffRule",
    "Blocks",
    "LogitsSignal",
    "MergeRule",
    "NoRule",
    "Node",
    "OutputRows",
    "Plan",
    "Rule",
    "RuleContractError",
    "SignalOnSeveralOutputs",
    "Wanted",
    "Wiring",
    "chain_layers",
    "chain_nodes",
    "disagreement",
    "graph_nodes",
    "is_exact_keras",
    "place_blocks",
    "plan_for",
    "register",
    "registered",
    "rule_for",
    "rules_squared_norms",
    "rules_tensor",
    "tiled_vjp",
    "tiled_vjps",
]
