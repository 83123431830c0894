"""``kvevents keygen``: a CURVE key pair for an encrypted event stream.

    kvevents keygen [--dir DIR] [--name NAME] [--force]

Writes ``DIR/NAME.key`` (the public key, to give to the other side) and
``DIR/NAME.key_secret`` (both keys, mode 0600, to keep), in the certificate format
``zmq.auth`` reads; prints both paths and the public key. Existing files are kept unless
``--force`` (exit 2 otherwise). One pair for the engine (``curve_secret_key_file`` in
its ``--kv-events-config``), one per subscriber (``kvevents router
--curve-secret-key-file``, its public key in the engine's ``curve_allowed_keys`` or as a
file in ``curve_allowed_keys_dir``).
"""

from __future__ import annotations

import argparse

from kvevents.transport.curve_keys import write_key_pair

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Write a CURVE key pair: NAME.key (public; give it to the other side) and "
        "NAME.key_secret (secret, mode 0600; keep it). An engine uses its secret file as "
        "curve_secret_key_file in --kv-events-config and lists subscribers' public keys in "
        "curve_allowed_keys or a curve_allowed_keys_dir of NAME.key files; a router or "
        "watch uses its own as --curve-secret-key-file and the engine's public key as "
        "--curve-server-key (or reads it from the engine's /server_info)."
    )
    parser.add_argument("--dir", default=".", metavar="DIR", help="directory to write into")
    parser.add_argument(
        "--name", default="kvevents", help="file name: NAME.key and NAME.key_secret"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace an existing pair of that name"
    )


def run(args: argparse.Namespace) -> int:
    public_path, secret_path, pair = write_key_pair(args.dir, args.name, force=args.force)
    print(f"public key:  {public_path}")
    print(f"secret key:  {secret_path} (mode 0600; keep it private)")
    print(f"public-key = {pair.public}")
    return 0
