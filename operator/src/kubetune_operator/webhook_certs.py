"""The admission webhook's serving certificate when the operator manages it itself (no cert-manager).

Each certificate is self-signed and marked as a CA, so it is its own trust anchor: the
ValidatingWebhookConfiguration's caBundle lists the certificate being served and the one that
will replace it. A certificate is replaced once two thirds of its life have passed, which leaves a
third of its life for the new bundle to reach the API server before the old one expires.
Pure functions of their arguments (the clock is passed in), so every rule here is unit-tested.
"""
from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass

# Replace a certificate when this share of its lifetime is over.
ROTATE_AFTER_SHARE = 2 / 3


@dataclass(frozen=True)
class ServingCertificate:
    certificate_pem: bytes
    key_pem: bytes
    not_before: datetime.datetime
    not_after: datetime.datetime

    def due_for_rotation(self, now: datetime.datetime) -> bool:
        lifetime = self.not_after - self.not_before
        return now >= self.not_before + lifetime * ROTATE_AFTER_SHARE


def issue(dns_names: list[str], lifetime: datetime.timedelta, now: datetime.datetime) -> ServingCertificate:
    """A new key and a self-signed certificate for DNS_NAMES (the webhook Service's names), valid
    from NOW for LIFETIME."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not dns_names:
        raise ValueError("the webhook certificate needs at least one DNS name (KUBETUNE_WEBHOOK_DNS_NAMES)")
    key = ec.generate_private_key(ec.SECP256R1())
    serial = x509.random_serial_number()
    # A subject of its own: a caBundle holds two of these during a rotation, and TLS clients pick
    # the trust anchor by subject (OpenSSL takes the first one with a matching name).
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0][:64]),
                      x509.NameAttribute(NameOID.SERIAL_NUMBER, format(serial, "x"))])
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now)
        .not_valid_after(now + lifetime)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return ServingCertificate(
        certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
        not_before=now, not_after=now + lifetime)


def ca_bundle(*certificates: ServingCertificate | None) -> str:
    """The base64 caBundle trusting each given certificate (None entries are left out)."""
    return base64.b64encode(b"".join(c.certificate_pem for c in certificates if c is not None)).decode()


def expiry(certificate_pem: bytes) -> datetime.datetime:
    """When a PEM certificate (e.g. one cert-manager wrote) expires."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(certificate_pem).not_valid_after_utc
