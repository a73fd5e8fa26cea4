"""The validating admission webhook: the trainer's own verdict, given at `kubectl apply` time.

The CRD schema and its CEL rules already refuse most bad input; the webhook adds what they
cannot express: the referenced S3 Secret exists, and the full typed model (the same checks
`kubetune validate` and the trainer make) accepts the spec.

kopf serves it and manages the ValidatingWebhookConfiguration `trainingjobs.kubetune.dev`,
pointing it at this pod's address with a self-signed certificate made at start-up, and removes
the hook again when the operator stops. failurePolicy is Ignore: when the operator is down,
TrainingJobs are still admitted on the schema and CEL alone, and the operator validates them
again when it reconciles — a webhook outage never blocks the cluster.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

WEBHOOK_CONFIGURATION = "trainingjobs.kubetune.dev"


def write_self_signed_certificate(address: str, directory: Path) -> tuple[Path, Path]:
    """A serving certificate for `address` (an IP or a DNS name), valid for a year; its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    try:
        san = x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        san = x509.DNSName(address)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubetune-operator-webhook")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName([san]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / "tls.crt", directory / "tls.key"
    certfile.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    keyfile.chmod(0o600)
    return certfile, keyfile


def configure_server(settings, address: str, port: int, cert_dir: Path) -> None:
    """Serve admission reviews on address:port and keep the webhook configuration pointed here."""
    import kopf

    certfile, keyfile = write_self_signed_certificate(address, cert_dir)
    settings.admission.server = kopf.WebhookServer(
        addr=address, port=port, host=address, certfile=str(certfile), pkeyfile=str(keyfile), cafile=str(certfile))
    settings.admission.managed = WEBHOOK_CONFIGURATION
