"""The kernel that `make run` and `make notebooks` start: over IPC, not TCP.

A kernel started over TCP logs "Kernel is running over TCP without
encryption" (ipykernel) once per notebook: a security warning on a learner's
first screen, for a kernel that only this process talks to. Over IPC (Unix
domain sockets in Jupyter's runtime folder, readable by you only) there is
nothing to warn about; jupyter_client removes the sockets with the kernel.
Windows has no IPC transport for ZeroMQ: there the kernel stays on TCP.

Its kernels are shut down without an interrupt: see
``LocalKernelManager._async_interrupt_kernel``.
"""

import os
import uuid

from jupyter_client.manager import AsyncKernelManager
from jupyter_core.paths import jupyter_runtime_dir
from traitlets import CaselessStrEnum, default


class LocalKernelManager(AsyncKernelManager):
    """A kernel manager whose kernels talk over IPC (TCP on Windows)."""

    transport = CaselessStrEnum(
        ["tcp", "ipc"], default_value="tcp" if os.name == "nt" else "ipc", config=True
    )

    @default("ip")
    def _ip_default(self):
        """An absolute path for the sockets: jupyter_client's default,
        ``kernel-ipc``, is relative, and a kernel started in the notebook's
        folder would listen where its client does not look."""
        if self.transport != "ipc":
            return super()._ip_default()
        folder = jupyter_runtime_dir()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.path.join(folder, f"kernel-{uuid.uuid4()}-ipc")

    async def _async_interrupt_kernel(self):
        """Interrupt the kernel (SIGINT), but not as the first step of a shutdown.

        jupyter_client's ``shutdown_kernel`` interrupts the kernel before it
        asks it to exit, to stop a running cell. Here a kernel is shut down
        only once its run has ended: papermill (``make run``) and nbclient
        (``make notebooks``) wait for every reply, papermill then for a
        ``kernel_info`` reply. The interrupt has nothing to stop; it lands,
        now and then, in the kernel's handler of that last request after the
        reply went out and before ipykernel sets SIGINT back to "ignore", and
        ipykernel prints ``[IPKernelApp] ERROR | KeyboardInterrupt caught in
        kernel.`` (``make run`` did, after notebook 07; likelier on a loaded
        machine and where the kernel's own threads hold the GIL).
        ``shutdown_kernel`` still ends a kernel that does not answer its
        shutdown request: SIGTERM, then SIGKILL, after ``shutdown_wait_time``.
        The public ``interrupt_kernel`` is jupyter_client's own, unchanged.
        """
        if self.shutting_down:
            return
        await super()._async_interrupt_kernel()
