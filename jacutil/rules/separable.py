"""SeparableConv1D and SeparableConv2D: a depthwise convolution, then a 1x1 one.

Keras's separable convolution is ``act(pointwise(depthwise(a)) + b)``: the
depthwise kernel (kh, kw, c_in, m) with the layer's strides, padding and
dilation, then the pointwise kernel (1, 1, c_in * m, filters), the bias and
the activation. Its rule is those two rules in a row
(:class:`~jacutil.rules.conv.DepthwiseConvRule`, then
:class:`~jacutil.rules.conv.ConvRule` of a 1x1 kernel), each on a view of the
layer that holds its kernel: the pointwise rule's signal below is the
depthwise rule's signal above. NASNet and Xception are built of them.
"""

from types import SimpleNamespace

from ..core._tf import keras
from .conv import ConvRule, DepthwiseConvRule
from .registry import Blocks, NoRule, Rule, register


def _views(layer):
    """The depthwise and pointwise convolutions of ``layer``, as the objects
    (attributes only) that the convolution rules read."""
    common = dict(
        name=layer.name, data_format=layer.data_format, rank=layer.rank,
        quantization_mode=None, lora_enabled=False,
    )  # fmt: skip
    depthwise = SimpleNamespace(
        kernel=layer.depthwise_kernel, use_bias=False, bias=None,
        activation=keras.activations.linear, strides=layer.strides,
        padding=layer.padding, dilation_rate=layer.dilation_rate,
        kernel_size=layer.kernel_size, **common,
    )  # fmt: skip
    ones = (1,) * layer.rank
    pointwise = SimpleNamespace(
        kernel=layer.pointwise_kernel, use_bias=layer.use_bias,
        bias=layer.bias if layer.use_bias else None, activation=layer.activation,
        strides=ones, padding="valid", dilation_rate=ones, kernel_size=ones,
        groups=1, **common,
    )  # fmt: skip
    return depthwise, pointwise


@register(keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
class SeparableConvRule(Rule):
    """``y = act(pointwise(depthwise(a)) + b)``: the depthwise rule, then the
    pointwise (1x1) convolution's rule; channels_first or a quantized layer
    raise :class:`NoRule`."""

    name = "separable_conv"

    def __init__(self, layer):
        super().__init__(layer)
        if getattr(layer, "quantization_mode", None):
            raise NoRule(
                f"a quantized separable convolution ({layer.quantization_mode})"
            )
        depthwise, pointwise = _views(layer)
        self.depthwise = DepthwiseConvRule(depthwise)
        self.pointwise = ConvRule(pointwise, "separable convolution")
        self.variables = [layer.depthwise_kernel, *self.pointwise.variables]
        self.runs_user_code = self.pointwise.runs_user_code
        self.takes_logits_signal = self.pointwise.takes_logits_signal

    def describe(self):
        """``"separable_conv2d"`` and the activation (a ``str``)."""
        return (
            f"separable_conv{self.layer.rank}d" + self.pointwise.activation.describe()
        )

    def _forward(self, a):
        h, inner = self.depthwise.forward(a)
        y, outer = self.pointwise.forward(h)
        return y, (inner, outer)

    def _backward(self, saved, delta, wanted, need_signal):
        inner, outer = saved
        deep = need_signal or self.layer.depthwise_kernel in wanted
        blocks, at_h = self.pointwise.backward(outer, delta, wanted, deep)
        below = None
        if deep:
            found, below = self.depthwise.backward(inner, at_h, wanted, need_signal)
            blocks = Blocks([*found.items(), *blocks.items()])
        return blocks, below

    def _backward_norms(self, saved, delta, wanted, need_signal):
        inner, outer = saved
        deep = need_signal or self.layer.depthwise_kernel in wanted
        squared, at_h = self.pointwise.backward_norms(outer, delta, wanted, deep)
        below = None
        if deep:
            more, below = self.depthwise.backward_norms(
                inner, at_h, wanted, need_signal
            )
            if more is not None:
                squared = more if squared is None else squared + more
        return squared, below
