"""Ed25519 keys and detached signatures (``cryptography``; no hand-written crypto).

The private key lives in one PEM file (0600) or in ``SIM2EDGE_SIGNING_KEY`` (a path, or the PEM
itself for CI secrets). Nothing here prints, logs or returns the private key's bytes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, List, Mapping, Optional

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


def generate_keypair(private_path: Path, public_path: Path) -> None:
    """Write a new key pair as PEM; the private key file is created 0600."""
    key = Ed25519PrivateKey.generate()
    private_path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(str(private_path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(public_pem(key))


ENV_KEY = "SIM2EDGE_SIGNING_KEY"


def _private_from_pem(pem: bytes, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:  # the message names the source, never the key's bytes
        raise ValueError(f"{where}: not a readable unencrypted PEM private key ({type(e).__name__})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{where}: not an Ed25519 private key")
    return key


def load_private(path: Path) -> Ed25519PrivateKey:
    return _private_from_pem(Path(path).read_bytes(), str(path))


def signing_key(default_path: Path, environ: Optional[Mapping[str, str]] = None) -> Ed25519PrivateKey:
    """The private key from ``SIM2EDGE_SIGNING_KEY`` (a PEM file's path, or PEM text) or else ``default_path``."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_KEY, "")
    if value.lstrip().startswith("-----BEGIN"):
        return _private_from_pem(value.encode(), f"${ENV_KEY} (PEM text)")
    if value:
        if not Path(value).is_file():
            raise ValueError(f"${ENV_KEY}: no key file at {value}")
        return load_private(Path(value))
    return load_private(default_path)


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public(path: Path) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(Path(path).read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key


def load_trusted(paths: Iterable[Path]) -> List[Ed25519PublicKey]:
    """Pinned public keys (several allowed, for key rotation)."""
    return [load_public(p) for p in paths]


def key_ids(trusted: Iterable[Ed25519PublicKey]) -> List[str]:
    """The sorted sha256 digests (hex, 16 digits) of the keys' raw bytes: which key set a check ran against."""
    import hashlib

    raw = (k.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) for k in trusted)
    return sorted(hashlib.sha256(b).hexdigest()[:16] for b in raw)


def verify(trusted: Iterable[Ed25519PublicKey], data: bytes, signature: bytes) -> bool:
    """True if any trusted key signed ``data``."""
    for key in trusted:
        try:
            key.verify(signature, data)
            return True
        except InvalidSignature:
            continue
    return False
