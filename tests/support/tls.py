"""A self-signed certificate for ``127.0.0.1`` for the TLS tests: made with the
``cryptography`` package (a test dependency), else with the ``openssl`` command; with
neither the test fails saying so."""

from __future__ import annotations

import datetime
import importlib.util
import ipaddress
import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed(where: Path) -> tuple[Path, Path]:
    """``(key.pem, cert.pem)`` in ``where``: an EC key and a certificate valid for a day,
    for the IP address 127.0.0.1 and the name localhost (clients verify it as its own CA)."""
    key, cert = where / "key.pem", where / "cert.pem"
    if importlib.util.find_spec("cryptography") is not None:
        _with_cryptography(key, cert)
    elif shutil.which("openssl") is not None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert),
             "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
            check=True, capture_output=True,
        )
    else:
        pytest.fail("the TLS test needs a certificate: install the `cryptography` package "
                    "(pip install cryptography, as .ci/test-requirements.txt lists) or the openssl "
                    "command")
    return key, cert


def _with_cryptography(key_path: Path, cert_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        # Python 3.13's strict verification wants both key identifiers, even self-signed.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
