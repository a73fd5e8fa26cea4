"""The admission webhook's certificate: issued and rotated by the operator before it expires (the
next one trusted before it is served), or reloaded from cert-manager's files, always without
restarting the server. TLS is real here: clients connect to a server using the keeper's context."""
from __future__ import annotations

import asyncio
import base64
import datetime
import ssl

import pytest
from cryptography import x509

from kubetune_operator import webhook, webhook_certs
from kubetune_operator.settings import Settings

NAMES = ["kubetune-webhook", "kubetune-webhook.kubetune-system.svc"]
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
HOUR = datetime.timedelta(hours=1)


class Clock:
    def __init__(self, start=T0):
        self.now = start

    def __call__(self):
        return self.now


class Bundles:
    """A stand-in for the ValidatingWebhookConfiguration's caBundle: what was published, and
    whether publishing works right now."""

    def __init__(self):
        self.published: list[str] = []
        self.reachable = True

    def __call__(self, bundle: str) -> bool:
        if not self.reachable:
            return False
        self.published.append(bundle)
        return True

    def trusted(self) -> bytes:
        return base64.b64decode(self.published[-1])


def certificates_in(bundle: bytes) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(bundle)


def test_a_certificate_names_the_service_and_is_its_own_ca():
    certificate = webhook_certs.issue(NAMES, 30 * 24 * HOUR, T0)
    parsed = x509.load_pem_x509_certificate(certificate.certificate_pem)
    assert parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == NAMES
    assert parsed.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert parsed.not_valid_after_utc == T0 + 30 * 24 * HOUR
    with pytest.raises(ValueError, match="KUBETUNE_WEBHOOK_DNS_NAMES"):
        webhook_certs.issue([], HOUR, T0)


def test_rotation_is_due_after_two_thirds_of_the_lifetime():
    certificate = webhook_certs.issue(NAMES, 30 * HOUR, T0)
    assert not certificate.due_for_rotation(T0 + 19 * HOUR)
    assert certificate.due_for_rotation(T0 + 20 * HOUR)


def test_the_next_certificate_is_published_beside_the_current_one_before_it_is_served():
    bundles, clock = Bundles(), Clock()
    source = webhook.OperatorCertificates(NAMES, 30 * HOUR, bundles)
    first = source.first(clock())
    assert certificates_in(bundles.trusted())[0].serial_number == x509.load_pem_x509_certificate(first.certificate_pem).serial_number
    assert source.tick(T0 + 10 * HOUR) is None and len(bundles.published) == 1

    assert source.tick(T0 + 20 * HOUR) is None, "a new certificate is not served before the API server trusts it"
    trusted = [c.serial_number for c in certificates_in(bundles.trusted())]
    assert len(trusted) == 2 and trusted[0] == x509.load_pem_x509_certificate(first.certificate_pem).serial_number
    assert source.tick(T0 + 20 * HOUR + datetime.timedelta(seconds=5)) is None, "the bundle gets time to propagate"

    successor = source.tick(T0 + 20 * HOUR + webhook.BUNDLE_PROPAGATION)
    assert successor is not None
    assert x509.load_pem_x509_certificate(successor.certificate_pem).serial_number == trusted[1]
    assert source.serving is successor and successor.not_after == T0 + 50 * HOUR


def test_a_bundle_that_cannot_be_published_keeps_the_current_certificate_and_is_retried():
    bundles, clock = Bundles(), Clock()
    bundles.reachable = False
    source = webhook.OperatorCertificates(NAMES, 30 * HOUR, bundles)
    first = source.first(clock())
    assert not source.published and bundles.published == []
    bundles.reachable = True
    assert source.tick(T0 + HOUR) is None and source.published, "the start-up bundle is published on the next look"

    bundles.reachable = False  # e.g. the configuration was deleted, or the operator restarted mid-rotation
    assert source.tick(T0 + 21 * HOUR) is None and source.pending is None and source.serving is first
    bundles.reachable = True
    assert source.tick(T0 + 22 * HOUR) is None and source.pending is not None
    successor = source.pending
    assert source.tick(T0 + 23 * HOUR) is successor and source.serving is successor


async def _served_serial(port: int, trusted: bytes) -> int:
    """Connect as the API server would: verifying the certificate against the caBundle TRUSTED and
    the Service's DNS name. Returns the serial number of the certificate the server presented."""
    client = ssl.create_default_context(cadata=trusted.decode())
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=NAMES[1])
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    return x509.load_der_x509_certificate(der).serial_number


async def _serve(context: ssl.SSLContext) -> tuple[asyncio.Server, int]:
    async def answer(reader, writer):
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


def test_the_operator_rotates_the_served_certificate_without_restarting_the_server(tmp_path):
    async def scenario():
        # TLS checks certificates against the real time: the first one was issued 20 hours ago.
        now = datetime.datetime.now(datetime.timezone.utc)
        bundles, clock = Bundles(), Clock(now - 20 * HOUR)
        keeper = webhook.CertificateKeeper(webhook.OperatorCertificates(NAMES, 30 * HOUR, bundles), tmp_path,
                                           check_every=1, clock=clock)
        server, port = await _serve(keeper.context)
        first = await _served_serial(port, bundles.trusted())

        clock.now = now
        await keeper.check()  # publishes the successor beside the current certificate
        assert await _served_serial(port, bundles.trusted()) == first
        clock.now += webhook.BUNDLE_PROPAGATION
        await keeper.check()  # and serves it
        second = await _served_serial(port, bundles.trusted())
        assert second != first
        assert webhook.metrics.WEBHOOK_CERTIFICATE_EXPIRY._value.get() == (now + 30 * HOUR).replace(microsecond=0).timestamp()
        with pytest.raises(ssl.SSLCertVerificationError):  # only the published bundle lets a client in
            await _served_serial(port, base64.b64decode(bundles.published[0]))
        initial_files = {keeper.certfile, keeper.keyfile}
        clock.now += 20 * HOUR
        await keeper.check()
        clock.now += webhook.BUNDLE_PROPAGATION
        await keeper.check()  # a third certificate (valid from 20 h ahead: no handshake with it here)
        assert len(bundles.published) == 3
        # The second one's files go; kopf's first pair stays, as kopf holds its paths.
        assert {p for p in tmp_path.iterdir()} == initial_files | set(keeper._rotated)
        server.close()

    asyncio.run(scenario())


def test_certificates_from_cert_manager_are_reloaded_when_the_secret_changes(tmp_path):
    def write(certificate):
        (tmp_path / "tls.crt").write_bytes(certificate.certificate_pem)
        (tmp_path / "tls.key").write_bytes(certificate.key_pem)

    async def scenario():
        now = datetime.datetime.now(datetime.timezone.utc)
        old, new = webhook_certs.issue(NAMES, 90 * 24 * HOUR, now - HOUR), webhook_certs.issue(NAMES, 90 * 24 * HOUR, now)
        write(old)
        keeper = webhook.CertificateKeeper(webhook.FileCertificates(tmp_path), tmp_path, check_every=1)
        server, port = await _serve(keeper.context)
        both = old.certificate_pem + new.certificate_pem
        old_serial = await _served_serial(port, both)

        (tmp_path / "tls.key").unlink()  # the kubelet swapping the Secret's files: keep serving
        await keeper.check()
        assert await _served_serial(port, both) == old_serial
        write(new)
        await keeper.check()
        assert await _served_serial(port, both) != old_serial
        assert await _served_serial(port, new.certificate_pem)
        server.close()

    asyncio.run(scenario())


def test_an_unknown_certificate_source_stops_the_operator_naming_the_helm_value():
    with pytest.raises(ValueError, match=r"webhook.certificates.*operator, files"):
        Settings.from_env({"KUBETUNE_WEBHOOK_CERTIFICATES": "letsencrypt"})
    settings = Settings.from_env({"KUBETUNE_WEBHOOK_DNS_NAMES": "a,a.ns.svc", "KUBETUNE_WEBHOOK_CERTIFICATE_LIFETIME_SECONDS": "60"})
    assert settings.webhook_dns_names == ("a", "a.ns.svc") and settings.webhook_check_seconds == 3
