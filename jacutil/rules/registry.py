"""The registry and the rule contract: which rule writes the blocks of which layer.

A rule is a class built from one layer. It says which of the layer's
variables it writes blocks for (``variables``), runs the layer forward
keeping what its backward step needs, and maps the per-sample signal
``delta[i, k, ...] = d y[i, k] / d (layer output)[i, ...]`` to its blocks
and to the signal of the layer below. Rules are looked up by the layer's
exact type: a subclass may compute something else, so it goes through
autodiff (``jacutil.rules.autodiff``) unless it registers a rule itself.

The contract is a template method (as BackPACK's derivatives): the public
:meth:`Rule.forward` and :meth:`Rule.backward` are final; a rule writes
``_forward`` and ``_backward``, and ``backward`` checks the shape of every
block and of the signal below against the layer's input before the engine
(``jacutil.rules.walk``) places the blocks in the Jacobian's columns. What
a rule can take is declared in class attributes (``shared_signal``,
``runs_user_code``, ``takes_logits_signal``), never guessed from its type.
"""

import abc
from contextlib import contextmanager
from typing import Any, final

import numpy as np

from ..core._shared import size_of
from ..core._tf import tf

RULES = {}  # layer type -> rule class


class NoRule(Exception):
    """Raised by a rule's constructor when its layer is configured beyond it."""


class AlreadyRegistered(ValueError):
    """A layer type already has a rule: ``register(..., overwrite=True)`` or
    ``with registered(...)`` replace it on purpose."""


class RuleContractError(AssertionError):
    """A rule broke the contract (a block or signal of the wrong shape, a
    block for a variable it was not asked for): a bug in the rule."""


def register(*layer_types, overwrite=False, table=None):
    """Class decorator: ``@register(keras.layers.Dense)`` makes the rule known
    for those exact layer types, in ``table`` (default ``RULES``); a type that
    has a rule raises :class:`AlreadyRegistered` unless ``overwrite``. The
    decorator returns the rule class unchanged.
    """
    table = RULES if table is None else table

    def add(rule):
        taken = [
            t for t in layer_types if table.get(t) not in (None, rule) and not overwrite
        ]
        if taken:
            names = ", ".join(t.__name__ for t in taken)
            raise AlreadyRegistered(
                f"{names} already has a rule ({table[taken[0]].__name__}); pass "
                f"overwrite=True, or use `with jacutil.rules.registered({names}, "
                f"{rule.__name__}):` to replace it for a while"
            )
        for layer_type in layer_types:
            table[layer_type] = rule
        return rule

    return add


@contextmanager
def registered(layer_types, rule):
    """``with registered(LayerType, RuleClass) as rule:`` the rule (a
    :class:`Rule` subclass) is the registered one for the layer type (or tuple
    of them) inside the block; the registry is restored as it was on leaving.
    """
    if not isinstance(layer_types, (tuple, list)):
        layer_types = (layer_types,)
    missing = object()
    before = {t: RULES.get(t, missing) for t in layer_types}
    register(*layer_types, overwrite=True)(rule)
    try:
        yield rule
    finally:
        for layer_type, previous in before.items():
            if previous is missing:
                RULES.pop(layer_type, None)
            else:
                RULES[layer_type] = previous


class LogitsSignal:
    """A signal at the logits ``z`` of a softmax or sigmoid, not at its
    output ``y``: what a Keras loss gives when it reads ``y``'s logits
    (the logits Keras keeps on ``y``, ``cached_logits``, or the input of a
    ``Softmax``/``Sigmoid`` op); ``delta`` has shape ``(n or 1, r, *logits_shape)``.
    """

    def __init__(self, delta):
        self.delta = delta

    @staticmethod
    def unwrapped(delta):
        """The signal's tensor: ``delta``, or the logits' one it wraps."""
        return delta.delta if isinstance(delta, LogitsSignal) else delta


class Wanted:
    """The variables whose blocks one backward step must write, by identity.

    ``variable in wanted`` (its ``id`` works too); iterating gives the
    variables. Keras variables cannot be dict keys, hence this set of the
    ``variables`` given (any iterable).
    """

    def __init__(self, variables=()):
        self._by_id = {id(v): v for v in variables}

    @classmethod
    def of(cls, wanted):
        """``wanted`` as a :class:`Wanted`: from one, an iterable of variables
        or a dict whose values are variables; TypeError if it holds integers
        (column positions)."""
        if isinstance(wanted, cls):
            return wanted
        variables = list(wanted.values() if isinstance(wanted, dict) else wanted)
        if any(isinstance(v, (int, np.integer)) for v in variables):
            raise TypeError(
                "wanted holds the variables themselves, not column positions"
            )
        return cls(variables)

    def __contains__(self, item):
        return (item if isinstance(item, int) else id(item)) in self._by_id

    def __iter__(self):
        return iter(self._by_id.values())

    def __len__(self):
        return len(self._by_id)

    def __repr__(self):
        return f"Wanted({[getattr(v, 'path', v) for v in self]})"


class Blocks:
    """A rule's blocks of columns, keyed by variable (by identity).

    ``blocks[kernel] = B`` with ``B`` of shape (n, l, kernel.size); a joint
    block ``blocks[(kernel, bias)] = B`` of shape (n, l, kernel.size +
    bias.size) holds the kernel's columns, then the bias's (one fused
    product). The engine places each in the Jacobian's column order and
    splits a joint block whose variables are not adjacent there. ``pairs``:
    ``(key, block)`` pairs to start with, a key a variable or a tuple of them.
    """

    def __init__(self, pairs=()):
        self._items = {}  # ids of the key's variables -> (variables, block)
        for key, block in pairs:
            self[key] = block

    @staticmethod
    def _variables(key):
        return tuple(key) if isinstance(key, (tuple, list)) else (key,)

    def __setitem__(self, key, block):
        variables = self._variables(key)
        self._items[tuple(id(v) for v in variables)] = (variables, block)

    def __getitem__(self, key):
        return self._items[tuple(id(v) for v in self._variables(key))][1]

    def __contains__(self, key):
        return tuple(id(v) for v in self._variables(key)) in self._items

    def __len__(self):
        return len(self._items)

    def keys(self):
        """Each block's key: a tuple of its variables (one, or kernel and bias)."""
        return [variables for variables, _ in self._items.values()]

    def items(self):
        """``[(variables, block)]``: a tuple of variables, an (n, l, size) block."""
        return list(self._items.values())

    def update(self, other):
        """Add (or replace) the blocks of ``other`` (anything :meth:`of` takes)."""
        for variables, block in Blocks.of(other).items():
            self[variables] = block

    def add(self, other):
        """Add the blocks of ``other`` (anything :meth:`of` takes), summed
        with a block already held for the same variables: a layer called
        twice (a tied embedding) contributes once per call. A joint block
        that meets another key only in part is split into one block per
        variable first (along the last axis, in its key's order)."""
        for variables, block in Blocks.of(other).items():
            ids = tuple(id(v) for v in variables)
            if ids in self._items:
                self._items[ids] = (variables, self._items[ids][1] + block)
                continue
            taken = {i for key in self._items for i in key}
            if taken.isdisjoint(ids):
                self[variables] = block
                continue
            mine = list(self._items.values())
            self._items.clear()
            for key, held in [*mine, (variables, block)]:
                parts = tf.split(held, [size_of(v) for v in key], axis=-1)
                for v, part in zip(key, parts, strict=True):
                    one = (id(v),)
                    if one in self._items:
                        part = self._items[one][1] + part
                    self._items[one] = ((v,), part)

    @classmethod
    def of(cls, blocks):
        """``blocks`` as :class:`Blocks`: from Blocks, None, ``{}`` or
        ``(key, block)`` pairs; TypeError for a non-empty dict (of column
        positions)."""
        if isinstance(blocks, cls):
            return blocks
        if blocks is None or (isinstance(blocks, dict) and not blocks):
            return cls()
        if isinstance(blocks, dict):
            raise TypeError(
                "a rule returns Blocks keyed by variable (jacutil.rules.Blocks), "
                "not a dict of column positions"
            )
        return cls(blocks)


class Rule(abc.ABC):
    """Base of every rule: one layer, its variables, forward and backward.

    A rule writes ``_forward`` (optional: by default the layer's own call)
    and ``_backward``; the engine calls the final :meth:`forward` and
    :meth:`backward`, which record the input's shape and check every shape
    a rule returns. Shapes: n samples, l outputs of the model, a layer input
    ``a`` of shape ``(n, *input_shape)`` and output ``(n, *output_shape)``.

    Capabilities, declared as class (or instance) attributes:

    - ``shared_signal``: ``_backward`` takes ``delta`` of shape (1, l, ...),
      one signal shared by every sample, when it writes no blocks.
    - ``runs_user_code``: it calls code that is not ours (autograph matters).
    - ``takes_logits_signal``: ``_backward`` takes a :class:`LogitsSignal`.
    - ``fast_under_xla``: its norms are a few small products that XLA fuses
      (measured faster under XLA; convolutions and recurrences are slower).
    - ``several_inputs``: the layer takes a list of inputs (a merge, e.g.
      ``Add``): ``a`` is that list, ``need_signal`` a list of bools (one per
      input) and the signal below a list (None where not needed).
    - ``kronecker_factors``: KFAC may factor its kernel and bias; it writes
      ``input_rows(a)`` (A's rows) and ``pre_activation(a)`` (where B's
      signal is read): :class:`jacutil.rules.dense.KernelRule`.

    A subclass's constructor takes the Keras layer, raises :class:`NoRule` for
    a configuration it does not cover, and sets ``self.variables``.
    """

    name: str = "rule"
    weighs_sums: bool = False  # writes _weighted_sums (DP-SGD's book-keeping)
    shared_signal: bool = False
    runs_user_code: bool = False
    takes_logits_signal: bool = False
    fast_under_xla: bool = False
    several_inputs: bool = False
    kronecker_factors: bool = False

    def __init__(self, layer):
        self.layer = layer
        self.variables: list = []
        self.input_shape = None  # (n, *input_shape) of the last forward
        self.input_dtype = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for method in ("forward", "backward", "backward_norms"):
            if method in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} overrides Rule.{method}, which checks the "
                    f"contract: write _{method} instead"
                )

    @final
    def forward(self, a) -> tuple[Any, Any]:
        """``(y, saved)``: the layer's output ``(n, *output_shape)`` on ``a``
        ``(n, *input_shape)``, and what :meth:`backward` needs (from ``_forward``).
        """
        y, saved = self._forward(a)
        if self.several_inputs:  # one shape and dtype per input
            self.input_shape = [tf.TensorShape(t.shape) for t in a]
            self.input_dtype = [tf.as_dtype(t.dtype) for t in a]
        else:
            self.input_shape = tf.TensorShape(a.shape)
            self.input_dtype = tf.as_dtype(a.dtype)
        return y, saved

    def _forward(self, a):
        """``(y, saved)``; by default the layer's call, and ``a`` saved."""
        return self.layer(a, training=False), a

    @final
    def backward(self, saved, delta, wanted, need_signal) -> tuple[Blocks, Any]:
        """The blocks and the signal below, shapes checked.

        Args:
            saved: what :meth:`forward` returned as ``saved``.
            delta: the signal at the layer's output, ``(n, l, *output_shape)``
                (or (1, l, ...) when ``shared_signal``), or a
                :class:`LogitsSignal` when ``takes_logits_signal``.
            wanted: the variables to write blocks for (a :class:`Wanted`, or
                any iterable of variables).
            need_signal: whether the signal below is needed.

        Returns:
            ``(blocks, below)``: :class:`Blocks`, one (n, l, size) block per
            wanted variable (or joint kernel and bias), and the signal at the
            layer's input ``(n or 1, l, *input_shape)``, or None when not needed
            (or when the input is not a float, e.g. Embedding's ids).

        Raises:
            RuleContractError: a block or the signal has the wrong shape, or a
                block is for a variable that was not wanted.
        """
        wanted = Wanted.of(wanted)
        found, below = self._backward(saved, delta, wanted, need_signal)
        blocks = Blocks.of(found)
        signal = LogitsSignal.unwrapped(delta)
        self._check_blocks(blocks, signal, wanted)
        return blocks, self._checked_below(below, signal, need_signal)

    @final
    def backward_norms(self, saved, delta, wanted, need_signal) -> tuple[Any, Any]:
        """The squared norms of the blocks, per sample and signal row, and the
        signal below - without the blocks, where the rule knows how.

        What per-sample gradient norms need (DP clipping): with a signal of one
        row, ``squared[i, 0]`` is the squared norm of sample i's gradient with
        respect to the wanted variables of this layer. Arguments and the
        signal below as :meth:`backward`; ``squared`` has shape (n, r), the sum
        over the wanted variables of each block's squared entries (zeros when
        none is wanted); RuleContractError when a shape is wrong.
        """
        wanted = Wanted.of(wanted)
        squared, below = self._backward_norms(saved, delta, wanted, need_signal)
        signal = LogitsSignal.unwrapped(delta)
        expected = [self._seen_samples(), signal.shape[1]]
        if squared is not None and not _agrees(squared.shape, expected):
            raise self._broken(
                f"the squared norms have shape {_shown(squared.shape)}, expected "
                f"(n, r) = {_shown(expected)}"
            )
        return squared, self._checked_below(below, signal, need_signal)

    @final
    def backward_squares(self, saved, delta, wanted, need_signal) -> tuple[Blocks, Any]:
        """Each block's squares summed over samples and signal rows, and the
        signal below - without the blocks where the rule knows how.

        With the columns of a square root of each sample's loss Hessian as
        the signal, the sums are the exact diagonal of the Gauss-Newton
        matrix (``jacutil.curvature.diagonal``, notebook 11). Arguments as
        :meth:`backward`; ``squares`` are :class:`Blocks` keyed as its blocks,
        each of shape (size,).
        """
        wanted = Wanted.of(wanted)
        squares, below = self._backward_squares(saved, delta, wanted, need_signal)
        signal = LogitsSignal.unwrapped(delta)
        return Blocks.of(squares), self._checked_below(below, signal, need_signal)

    @final
    def weighted_sums(self, saved, delta, wanted, weights) -> Blocks:
        """``sum_i w_i`` of each sample's block, one per wanted variable, of
        shape (size,), for a signal of one row: with ``w_i`` DP-SGD's clip
        weights, the clipped sum of the gradients from the norms' own
        forward and backward pass ("book-keeping", Bu et al., 2023), no
        second pass. ``weights`` (n,) in the signal's dtype; a row of weight
        0 contributes nothing, even where its signal is NaN. Only for a rule
        whose ``weighs_sums`` is true."""
        if not self.weighs_sums:
            raise NotImplementedError(f"{self.describe()} has no weighted sums")
        return Blocks.of(self._weighted_sums(saved, delta, Wanted.of(wanted), weights))

    def _weighted_sums(self, saved, delta, wanted, weights):
        """:meth:`weighted_sums`' Blocks; written by a rule with ``weighs_sums``."""
        raise NotImplementedError

    def _backward_squares(self, saved, delta, wanted, need_signal):
        """``(squares, below)`` as :meth:`backward_squares` returns them; by
        default from the blocks. A rule that knows a cheaper way (a Dense
        kernel's ``sum_i a_i^2 (x) sum_r delta_ir^2``) overrides it."""
        blocks, below = self.backward(saved, delta, wanted, need_signal)
        squares = Blocks(
            (key, tf.reduce_sum(tf.square(block), axis=[0, 1]))
            for key, block in blocks.items()
        )
        return squares, below

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """``(squared, below)`` as :meth:`backward_norms` returns them (None for
        no wanted variable). By default from the blocks: a rule that knows a
        cheaper way (the outer product's ``|a|^2 |delta|^2``) overrides it."""
        blocks, below = self.backward(saved, delta, wanted, need_signal)
        squared = None
        for _, block in blocks.items():
            part = tf.reduce_sum(tf.square(block), axis=-1)
            squared = part if squared is None else squared + part
        return squared, below

    @abc.abstractmethod
    def _backward(self, saved, delta, wanted, need_signal):
        """``(blocks, below)`` as :meth:`backward` returns them; ``blocks`` a
        :class:`Blocks` (``{}`` when none), ``below`` anything when not
        ``need_signal``."""

    def describe(self):
        """The rule's name as the plan shows it (a ``str``), e.g. ``"dense+relu"``."""
        return self.name

    def _broken(self, what):
        return RuleContractError(
            f"rule {type(self).__name__} ({self.describe()}) of layer "
            f"{self.layer.name!r}: {what}"
        )

    def _seen_samples(self):
        """n in the last forward's input (the first input's), or None."""
        seen_shape = getattr(self, "input_shape", None)
        if seen_shape is None:
            return None
        return (seen_shape[0] if self.several_inputs else seen_shape)[0]

    def _checked_below(self, below, signal, need_signal):
        """The signal below, checked against the input (or each input)."""
        if not self.several_inputs:
            if not need_signal:
                return None
            self._check_below(below, signal)
            return below
        if not any(need_signal):
            return [None] * len(need_signal)
        if not isinstance(below, (list, tuple)) or len(below) != len(need_signal):
            raise self._broken(
                f"the signal below is not a list of {len(need_signal)} signals, "
                "one per input"
            )
        shapes = getattr(self, "input_shape", None) or [None] * len(below)
        dtypes = getattr(self, "input_dtype", None) or [None] * len(below)
        checked = []
        for part, needed, shape, dtype in zip(
            below, need_signal, shapes, dtypes, strict=True
        ):
            if needed:
                self._check_below(part, signal, shape, dtype)
            checked.append(part if needed else None)
        return checked

    def _check_blocks(self, blocks, signal, wanted):
        ours = {id(v) for v in self.variables}
        n_samples = self._seen_samples()
        n_outputs = signal.shape[1] if tf.TensorShape(signal.shape).rank else None
        seen = set()
        for variables, block in blocks.items():
            names = ", ".join(getattr(v, "path", str(v)) for v in variables)
            for v in variables:
                if id(v) not in ours or v not in wanted:
                    raise self._broken(f"a block for {names}, which was not wanted")
                if id(v) in seen:
                    raise self._broken(f"two blocks for {getattr(v, 'path', v)}")
                seen.add(id(v))
            if block is None:
                raise self._broken(f"the block of {names} is None")
            expected = [n_samples, n_outputs, sum(size_of(v) for v in variables)]
            if not _agrees(block.shape, expected):
                raise self._broken(
                    f"the block of {names} has shape {_shown(block.shape)}, expected "
                    f"(n, l, size) = {_shown(expected)}"
                )

    def _check_below(self, below, signal, input_shape=None, input_dtype=None):
        """Check one signal below against ``input_shape`` (default: the input's)."""
        if input_shape is None:
            input_shape = getattr(self, "input_shape", None)
            input_dtype = getattr(self, "input_dtype", None)
        if input_shape is None:
            return
        if below is None:
            if input_dtype.is_floating:
                raise self._broken("no signal below, though it was asked for")
            return
        rows = below.shape[0] if below.shape.rank else None
        allowed = {input_shape[0], signal.shape[0]} - {None}
        if signal.shape[0] is None:
            allowed.add(1)  # a signal shared by every sample, unknown while traced
        expected = [None, signal.shape[1], *input_shape[1:]]
        if not _agrees(below.shape, expected) or (
            rows is not None and input_shape[0] is not None and rows not in allowed
        ):
            expected[0] = input_shape[0]
            raise self._broken(
                f"the signal below has shape {_shown(below.shape)}, expected "
                f"(n, l, *input_shape) = {_shown(expected)}"
            )


def _agrees(shape, expected):
    """Whether a (static) shape matches ``expected``; None is any size."""
    shape = tf.TensorShape(shape)
    if shape.rank is None:
        return True
    if shape.rank != len(expected):
        return False
    pairs = zip(shape, expected, strict=True)
    return all(a is None or b is None or a == b for a, b in pairs)


def _shown(shape):
    dims = list(shape) if tf.TensorShape(shape).rank is not None else ["..."]
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def rule_for(layer, table=None):
    """``(rule, None)`` for ``layer``, or ``(None, reason)`` (a ``str``) when
    it has none in ``table`` (from layer type to rule class; by default
    ``RULES``, of one-input layers; merge layers have
    ``jacutil.rules.merge.MERGE_RULES``)."""
    rule = (RULES if table is None else table).get(type(layer))
    if rule is None:
        return None, f"no rule for {type(layer).__name__}"
    try:
        return rule(layer), None
    except NoRule as reason:
        return None, str(reason)


def rows(delta):
    """``(n, l, *shape)`` -> ``(n * l, *shape)``: one row per sample and output."""
    return tf.reshape(delta, tf.concat([[-1], tf.shape(delta)[2:]], 0))


def per_output(rows_, n_samples, n_outputs):
    """``(n * l, *shape)`` -> ``(n, l, *shape)`` for n = ``n_samples`` and
    l = ``n_outputs``: the inverse of :func:`rows`."""
    shape = tf.concat([[n_samples, n_outputs], tf.shape(rows_)[1:]], 0)
    return tf.reshape(rows_, shape)
