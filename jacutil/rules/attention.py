"""MultiHeadAttention: four EinsumDense rules around an attention core.

Keras's ``MultiHeadAttention`` projects query, key and value by EinsumDense
layers, attends (scores, masked softmax, weighted values) and projects the
heads back. Its variables are the four projections' (with LoRA, their
factors), so its blocks, ghost norms and book-kept sums are those of the
EinsumDense rule (``jacutil.rules.einsum_dense``) - the per-sample norms of
the linear layers of a transformer by Gram matrices, as Li et al. 2022
("Large language models can be strong differentially private learners")
and Opacus's ghost clipping do. The core has no variables: the signal
passes through it by autodiff on the tiled rows
(:func:`jacutil.rules.autodiff.tiled_vjps` on q, k and v), its mask (from
``attention_mask``, ``use_causal_mask``, ``value_mask`` and ``key_mask``)
computed once, as the layer's own call computes it.

The rule replays the layer's one call in the functional graph (query, value,
key and masks from its arguments); a layer called several times, a gated
one, one returning its scores or whose inputs carry Keras masks raises
:class:`NoRule`.
"""

import inspect

from ..core._tf import keras, tf
from ..core.internals import calls_of
from .autodiff import tiled_vjps
from .einsum_dense import EinsumDenseRule
from .registry import Blocks, NoRule, Rule, Wanted, register

_TENSORS = ("query", "value", "key", "value_mask", "key_mask", "attention_mask")
_PARTS = ("_query_dense", "_key_dense", "_value_dense", "_output_dense")


def _the_call(layer):
    """``(arguments, inputs)``: the bound arguments of the layer's only call
    in a functional graph, and its symbolic inputs in the graph's order."""
    calls = calls_of(layer)
    if len(calls) != 1:
        raise NoRule(f"a MultiHeadAttention called {len(calls)} times, not once")
    call = calls[0]
    arguments = call.arguments
    try:
        signature = inspect.signature(layer.call)
        bound = signature.bind(*arguments.args, **arguments.kwargs)
    except TypeError as error:
        raise NoRule(
            f"a MultiHeadAttention call that cannot be replayed ({error})"
        ) from None
    return dict(bound.arguments), list(call.input_tensors)


@register(keras.layers.MultiHeadAttention)
class MultiHeadAttentionRule(Rule):
    """Query, key, value and output projections by :class:`EinsumDenseRule`,
    the attention core by autodiff. Takes the tensors of the layer's call in
    the graph's order (``several_inputs``)."""

    name = "multi_head_attention"
    several_inputs = True
    weighs_sums = True

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "_use_gate", False):
            raise NoRule("a gated MultiHeadAttention (use_gate)")
        arguments, inputs = _the_call(layer)
        if arguments.get("return_attention_scores"):
            raise NoRule("a MultiHeadAttention that returns its scores")
        if arguments.get("query_mask") is not None:
            raise NoRule("a MultiHeadAttention given query_mask (Keras ignores it)")
        self.causal = bool(arguments.get("use_causal_mask", False))
        self.inputs = inputs  # the symbolic tensors whose values forward takes
        self.slots = self._slots(arguments, inputs)
        self.parts = [EinsumDenseRule(getattr(layer, name)) for name in _PARTS]
        self.variables = [v for part in self.parts for v in part.variables]

    def _slots(self, arguments, inputs):
        """``{argument: position in inputs}``, each reading of a tensor its own
        position where it is read twice (the walk sums their signals)."""
        free = list(range(len(inputs)))
        slots = {}
        for name in _TENSORS:
            value = arguments.get(name)
            if value is None:
                continue
            if not isinstance(value, keras.KerasTensor):
                raise NoRule(f"a MultiHeadAttention given a constant {name}")
            if getattr(value, "_keras_mask", None) is not None:
                raise NoRule(f"a MultiHeadAttention whose {name} carries a Keras mask")
            at = [j for j in free if inputs[j] is value]
            if not at:
                at = [j for j, t in enumerate(inputs) if t is value]
            slots[name] = at[0]
            if at[0] in free:
                free.remove(at[0])
        if "query" not in slots or "value" not in slots:
            raise NoRule("a MultiHeadAttention call without query and value")
        return slots

    def describe(self):
        """The projections' rules and the core, in words (a ``str``)."""
        lora = "+lora" if any(part.lora is not None for part in self.parts) else ""
        return f"{self.name} (einsum_dense x4{lora}, its softmax core by vjp)"

    def _forward(self, a):
        layer, slot = self.layer, self.slots
        query, value = a[slot["query"]], a[slot["value"]]
        key = a[slot["key"]] if "key" in slot else value
        masks = {
            name: a[slot[name]]
            for name in ("value_mask", "key_mask", "attention_mask") if name in slot
        }  # fmt: skip
        causal_only = self.causal and not masks and layer._sliding_window is None
        mask = None
        if not causal_only:
            mask = layer._compute_attention_mask(
                query, value, use_causal_mask=self.causal, **masks
            )
        projected, kept = [], []
        for part, x in zip(self.parts[:3], (query, key, value), strict=True):
            y, saved = part.forward(x)
            projected.append(y)
            kept.append(saved)
        core = self._core(causal_only)
        extra = [] if mask is None else [mask]
        attended = core(*projected, *extra)
        y, saved = self.parts[3].forward(attended)
        kept.append(saved)
        return y, (kept, projected, extra, causal_only, [tf.shape(t) for t in a], a)

    def _core(self, causal_only):
        layer = self.layer
        options = {"use_causal_mask": True} if causal_only else {}

        def core(query, key, value, mask=None):
            return layer._compute_attention(
                query, key, value, mask, training=False, **options
            )[0]

        return core

    def _walk(self, saved, delta, wanted, need_signal, visit):
        """``(results, below)``: ``visit(part, saved, delta, wanted, need)``
        -> ``(result, signal)`` on the output projection, then the core's
        signal by autodiff, then the three input projections."""
        kept, projected, extra, causal_only, _, inputs = saved
        slot = self.slots
        asked = [Wanted(v for v in p.variables if v in wanted) for p in self.parts]
        result, core_delta = visit(self.parts[3], kept[3], delta, asked[3], True)
        results = [result]
        reads = (slot["query"], slot.get("key", slot["value"]), slot["value"])
        needs = [bool(asked[k]) or need_signal[j] for k, j in enumerate(reads)]
        signals = tiled_vjps(
            self._core(causal_only), [*projected, *extra], core_delta,
            needs + [False] * len(extra),
        )  # fmt: skip
        below = [None] * len(inputs)
        for k, j in enumerate(reads):
            if not needs[k]:
                continue
            result, part_below = visit(
                self.parts[k], kept[k], signals[k], asked[k], need_signal[j]
            )
            results.append(result)
            if need_signal[j] and part_below is not None:
                below[j] = part_below if below[j] is None else below[j] + part_below
        for j, x in enumerate(inputs):
            if need_signal[j] and below[j] is None and x.dtype.is_floating:
                shape = tf.concat([tf.shape(delta)[:2], tf.shape(x)[1:]], 0)
                below[j] = tf.zeros(shape, delta.dtype)  # a mask read as a float
        return results, below

    def _backward(self, saved, delta, wanted, need_signal):
        results, below = self._walk(saved, delta, wanted, need_signal, _blocks)
        blocks = Blocks()
        for found in results:
            blocks.update(found)
        return blocks, below

    def _backward_norms(self, saved, delta, wanted, need_signal):
        """The sum of the four projections' squared norms (their ghost norms)."""
        results, below = self._walk(saved, delta, wanted, need_signal, _norms)
        parts = [squared for squared in results if squared is not None]
        return (tf.add_n(parts) if parts else None), below

    def _weighted_sums(self, saved, delta, wanted, weights):
        """The four projections' weighted sums, each from its own signal."""

        def sums(part, kept, signal, asked, need):
            _, below = part.backward(kept, signal, Wanted(), need)
            found = part.weighted_sums(kept, signal, asked, weights) if asked else {}
            return found, below

        need = [False] * len(saved[-1])
        results, _ = self._walk(saved, delta, wanted, need, sums)
        found = Blocks()
        for part in results:
            found.update(part)
        return found


def _blocks(part, kept, delta, asked, need):
    return part.backward(kept, delta, asked, need)


def _norms(part, kept, delta, asked, need):
    return part.backward_norms(kept, delta, asked, need)
