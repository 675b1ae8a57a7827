"""TLS credentials for Dask workers (notebook 10-beyond-one-machine).

Dask's protocol is pickle: whoever can connect to a scheduler or a worker can
run code there. With TLS and one certificate that the scheduler, the workers
and the client all present, only a process holding the key connects.

``python -m jacutil.scale.credentials FOLDER`` writes ``ca.pem``,
``cert.pem`` and ``key.pem`` (readable by you only) from Dask's
``Security.temporary()``: copy FOLDER to each machine of the cluster and
pass the three files to ``dask scheduler`` and ``dask worker`` (README,
"On a cluster"). :func:`security_from` gives the driver's ``Security``.
"""

import argparse
import os
from pathlib import Path

FILES = ("ca.pem", "cert.pem", "key.pem")


def write_credentials(folder):
    """Write a new certificate authority, certificate and key (``ca.pem``,
    ``cert.pem``, ``key.pem``, mode 0600) into ``folder`` (made with mode 0700
    if need be); return a dict from ``"ca"``, ``"cert"`` and ``"key"`` to each
    file's path. An existing file is never overwritten: ``FileExistsError``."""
    from distributed import Security

    temporary = Security.temporary()  # one key and certificate for every role
    contents = {
        "ca.pem": temporary.tls_ca_file,
        "cert.pem": temporary.tls_client_cert,
        "key.pem": temporary.tls_client_key,
    }
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {}
    for name in FILES:
        path = folder / name
        try:
            handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"{path} exists already: credentials are never overwritten. "
                "Write into another folder, or remove the old ones first."
            ) from None
        with os.fdopen(handle, "w") as file:
            file.write(contents[name])
        paths[name.split(".")[0]] = str(path)
    return paths


def security_from(folder):
    """The driver's ``distributed.Security`` from a folder written by
    :func:`write_credentials`: it requires encryption and presents the
    folder's certificate (pass it to ``Client(address, security=...)``).
    ``FileNotFoundError`` names a missing file."""
    from distributed import Security

    folder = Path(folder)
    for name in FILES:
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder / name} is missing: make the credentials with "
                f"python -m jacutil.scale.credentials {folder}"
            )
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    return Security(
        tls_ca_file=str(folder / "ca.pem"),
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


def main(argv=None):
    """``python -m jacutil.scale.credentials FOLDER``: write the three files."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="where to write ca.pem, cert.pem, key.pem")
    folder = parser.parse_args(argv).folder
    try:
        written = write_credentials(folder)
    except FileExistsError as error:  # a second run: one line, not a traceback
        parser.exit(1, f"{parser.prog}: {error}\n")
    for role, path in written.items():
        print(f"{role:>4}: {path}")


if __name__ == "__main__":
    main()
