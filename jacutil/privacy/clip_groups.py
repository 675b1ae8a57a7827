"""Per-layer clipping for DP-SGD: a clip norm per group of layers
(notebook 09-matrix-free).

Flat clipping scales each sample's whole gradient to norm at most C.
Per-layer clipping (Opacus's ``clipping="per_layer"``; McMahan et al., 2018)
splits the trainable variables into groups, each with its own C_g, and
scales each sample's gradient *on each group* to norm at most C_g. A
sample's clipped gradient then has norm at most ``sqrt(sum_g C_g^2)``: that
is the sensitivity the noise must cover, so the noise's standard deviation
is sigma times it, and the accountant is unchanged.
"""

import math

import numpy as np

from ..core._tf import tf
from ..core.internals import layers_within


def _clip_value(value, where):
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} is {value!r}; a number > 0.")
    if not value > 0 or not math.isfinite(value):
        raise ValueError(
            f"{where} is {value!r}; it must be a finite number > 0: each "
            "sample's gradient is scaled down to at most this norm (a common "
            "start: about the median gradient norm early in training, e.g. 1.0)."
        )
    return float(value)


def clip_weights(norms, l2_norm_clip):
    """The weights ``w_i = min(1, C / |g_i|)`` that clip each gradient to norm C.

    ``w_i g_i`` is ``g_i`` when its norm is at most C and ``g_i`` scaled to
    norm C otherwise; a zero gradient gets the weight 1, and a non-finite
    one (NaN or infinity) the weight 0: it contributes nothing, rather than
    NaN to every weight. Introduced in ``09-matrix-free``.

    ``norms`` are the per-sample gradient norms, shape (n,), and
    ``l2_norm_clip`` is C. Returns a float64 NumPy array of shape (n,), every
    entry in [0, 1].

    Examples:
        >>> clip_weights([0.5, 2.0, 0.0, np.nan], 1.0)
        array([1. , 0.5, 1. , 0. ])
    """
    norms = np.asarray(norms, dtype=np.float64)
    finite = np.isfinite(norms)
    over = finite & (norms > l2_norm_clip)
    weights = np.where(finite, 1.0, 0.0)
    weights[over] = l2_norm_clip / norms[over]
    return weights


class ClipGroups:
    """``l2_norm_clip`` read as groups of variables, each with its clip norm.

    A number C: one group of every trainable variable (flat clipping). A dict
    ``{layer name: C_g}`` (a key may be a tuple of layer names, one group
    for them all): per-layer clipping; each trainable variable must be in
    exactly one group. Introduced in ``09-matrix-free``.

    Attributes:
        groups: ``[(names, indices into variables, C_g)]``, in the dict's order.
        norms: the C_g, a float64 array of shape (groups,).
        total: ``sqrt(sum_g C_g^2)``, the largest norm a sample's clipped
            gradient can have: the noise's scale.
        flat: whether there is one group of every variable.
    """

    def __init__(self, model, variables, l2_norm_clip):
        self.clips = l2_norm_clip  # as given: what a rebuilt DPSGD takes again
        if not isinstance(l2_norm_clip, dict):
            clip = _clip_value(l2_norm_clip, "l2_norm_clip")
            self.groups = [((), list(range(len(variables))), clip)]
            self.flat = True
        else:
            self.groups = self._read(model, variables, l2_norm_clip)
            self.flat = False
        self.norms = np.array([clip for *_, clip in self.groups], np.float64)
        self.total = float(np.sqrt(np.sum(self.norms**2)))
        self.variable = None  # the clip norm as it adapts (adaptive clipping)

    def adapt(self):
        """Hold the clip norm in a variable that each step may move (flat
        clipping only: :class:`jacutil.privacy.adaptive_clip.AdaptiveClip`)."""
        if not self.flat:
            raise ValueError(
                "adaptive clipping follows one quantile of the whole gradient's "
                "norms: give l2_norm_clip as one number (the starting C), not "
                "a clip norm per layer."
            )
        self.variable = tf.Variable(self.norms, trainable=False, dtype=tf.float64)

    def current(self):
        """The clip norm now: ``total``, or the adapting variable's value
        (a scalar tensor) under adaptive clipping."""
        if self.variable is None:
            return self.total
        return self.variable[0]

    @staticmethod
    def _read(model, variables, clips):
        if not clips:
            raise ValueError("l2_norm_clip is an empty dict; give {layer name: C}.")
        by_name = {
            layer.name: layer
            for layer in layers_within(model, include_self=False)
            if layer.trainable_variables
        }
        position = {id(v): i for i, v in enumerate(variables)}
        owner, groups = {}, []
        for key, value in clips.items():
            names = key if isinstance(key, tuple) else (key,)
            clip = _clip_value(value, f"l2_norm_clip[{key!r}]")
            indices = []
            for name in names:
                if name not in by_name:
                    raise ValueError(
                        f"l2_norm_clip names the layer {name!r}, which is not a "
                        "layer of the model with trainable variables; those are: "
                        f"{sorted(by_name)}."
                    )
                for variable in by_name[name].trainable_variables:
                    i = position[id(variable)]
                    if i in owner:
                        raise ValueError(
                            f"the variable {variable.path!r} is in two groups of "
                            f"l2_norm_clip ({owner[i]!r} and {key!r}); each "
                            "variable is clipped once: name its layer once."
                        )
                    owner[i] = key
                    indices.append(i)
            groups.append((names, sorted(indices), clip))
        missing = [v.path for i, v in enumerate(variables) if i not in owner]
        if missing:
            layers = [
                name
                for name, layer in by_name.items()
                if any(position[id(v)] not in owner for v in layer.trainable_variables)
            ]
            raise ValueError(
                f"l2_norm_clip leaves the layers {layers} in no group (their "
                f"variables {missing}), so their gradients would go unclipped "
                "and break the guarantee: add them to the dict (or freeze them)."
            )
        return groups

    def variables_of(self, variables):
        """Each group's variables: a list of lists."""
        return [[variables[i] for i in indices] for _, indices, _ in self.groups]

    def weights(self, norms, valid):
        """Compiled-friendly: ``(weights, skipped)`` from ``norms`` (rows,
        groups) in float64: ``w_ig = min(1, C_g / |g_ig|)``, 0 for a padding
        row (``valid`` 0) and for a sample with a non-finite norm in any group
        (``skipped``, (rows,)), which then contributes nothing."""
        clip = tf.constant(self.norms, tf.float64) if self.variable is None else (
            tf.convert_to_tensor(self.variable)
        )  # fmt: skip
        finite = tf.reduce_all(tf.math.is_finite(norms), axis=1)
        scaled = tf.where(norms > clip, clip / norms, tf.ones_like(norms))
        keep = tf.cast(finite, tf.float64) * valid
        weights = tf.where(finite[:, None], scaled, tf.zeros_like(norms))
        skipped = tf.logical_not(finite) & (valid > 0)
        return weights * keep[:, None], skipped

    def as_shown(self, weights):
        """A weight array as users read it: (rows,) for flat clipping,
        (rows, groups) per layer."""
        weights = np.asarray(weights)
        return weights[:, 0] if self.flat else weights

    def describe(self):
        """The clipping in words, for make_private's printed line."""
        if self.flat:
            return f"l2_norm_clip = {self.total:g}"
        parts = ", ".join(
            f"{'+'.join(names)}: {clip:g}" for names, _, clip in self.groups
        )
        return f"per-layer clip norms {parts}; sqrt(sum C_g^2) = {self.total:.4g}"
