"""A certificate authority of the test's own and server certificates it signed, as a company's internal CA
signs its services' (in no system store): for tests of https:// verifiers. Needs the `cryptography` package
(callers skip without it: `pytest.importorskip("cryptography")` first)."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_NAME = "raygrpo test CA"


def _cert(subject: str, key, signer, *, ca: bool, names: list | None = None, issuer: str = CA_NAME) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(signer, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key) -> None:
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def make_pki(directory: Path) -> Path:
    """Writes into `directory`: ca.pem (the CA), and good.pem / good.key (a server certificate for 127.0.0.1
    and localhost) and other.pem / other.key (one for another host, verifier.internal), both signed by the CA.
    For mutual TLS: client.pem / client.key (a client certificate the CA signed) and stranger.pem /
    stranger.key (one another CA signed). Returns `directory`."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(CA_NAME, ca_key, ca_key, ca=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    hosts = {"good": [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
             "other": [x509.DNSName("verifier.internal")]}
    for name, sans in hosts.items():
        key = ec.generate_private_key(ec.SECP256R1())
        _write(directory, name, _cert(name, key, ca_key, ca=False, names=sans), key)
    key = ec.generate_private_key(ec.SECP256R1())
    _write(directory, "client", _cert("raygrpo trainer", key, ca_key, ca=False), key)
    key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    _write(directory, "stranger", _cert("someone else", key, other_ca_key, ca=False, issuer="another CA"), key)
    return directory
