"""Import TensorFlow once, without its C++ start-up log.

TensorFlow 2.21 writes "oneDNN custom operations are on" and "Could not find cuda
drivers" to the process's standard error while it loads, before any Python logging
setting applies. In JupyterLab that text becomes a red box under the first import, so
we point file descriptor 2 at /dev/null for the length of the import only.

After the import, TensorFlow's C++ log is kept to fatal messages
(``TF_CPP_MIN_LOG_LEVEL=3``) unless you set the variable yourself before
importing jacutil: on a CPU without AVX-512 it writes "E ... oneDNN supports
DT_INT32 only on platforms with AVX-512. Falling back to the default
Eigen-based implementation" the first time a graph holds such an op (the
Hessian's products do) - an error-level line for a harmless fallback, a red
box in a learner's notebook. Errors that matter reach Python as exceptions.
"""

import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@contextlib.contextmanager
def _stderr_silenced():
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2: nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


with _stderr_silenced():
    import keras  # noqa: E402
    import tensorflow as tf  # noqa: E402

    tf.config.list_physical_devices()  # device probing logs here, silenced too

# TensorFlow's Python logger is left as the user set it: its warnings (such as
# retracing) are theirs to see.

__all__ = ["tf", "keras"]
