"""Ed25519 keys and detached signatures (``cryptography``; no hand-written crypto)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, List

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


def load_private(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


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


def verify(trusted: Iterable[Ed25519PublicKey], data: bytes, signature: bytes) -> bool:
    """True if any trusted key signed ``data``."""
    for key in trusted:
        try:
            key.verify(signature, data)
            return True
        except InvalidSignature:
            continue
    return False
