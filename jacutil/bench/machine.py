"""Where the numbers come from: CPU, load, versions (``07-benchmark``)."""

import os
import platform
import time

import numpy as np

from .. import peers
from ..core._tf import tf
from .paths import PEERS


def machine_summary():
    """The platform, CPUs, load average, Python and library versions, date.

    Returns:
        A dict (the results' ``machine``).
    """
    versions = {"tensorflow": tf.__version__, "numpy": np.__version__}
    for name in PEERS:
        if peers.available(name):
            versions[name] = __import__(name).__version__
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(v, 2) for v in os.getloadavg()],
        "python": platform.python_version(),
        "versions": versions,
        "threads": {  # OpenMP settings: they decide PyTorch's CPU speed here
            k: os.environ[k]
            for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
            if k in os.environ
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
