"""Small helpers for the notebooks: show a function's source, name the device."""

import inspect

from ..core._tf import tf


def show_source(obj):
    """Display the source of a ``jacutil`` function as a highlighted code block.

    The notebooks show the code that the package runs - not a second copy.
    ``obj``: a function, class or method whose source ``inspect`` can find.
    """
    from IPython.display import Markdown, display

    display(Markdown(f"```python\n{inspect.getsource(obj)}```"))


def device_summary():
    """One line: TensorFlow's version and the devices that will run the code."""
    gpus = tf.config.list_logical_devices("GPU")
    where = f"{len(gpus)} GPU(s): " + ", ".join(g.name for g in gpus) if gpus else "CPU"
    return f"TensorFlow {tf.__version__}, running on {where}"
