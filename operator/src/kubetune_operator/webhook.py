"""The validating admission webhook: the trainer's own verdict, given at `kubectl apply` time.

The CRD schema and its CEL rules already refuse most bad input; the webhook adds what they
cannot express: the full typed model (the same checks
`kubetune validate` and the trainer make) accepts the spec.

The Helm chart owns the ValidatingWebhookConfiguration and the Service the API server calls it
through; the operator only serves, and keeps a valid certificate in its TLS context without ever
restarting the server. Where the certificate comes from (Settings.webhook_certificates):
  * "operator": the operator issues its own (webhook_certs.py), publishes it in the caBundle of
    the configuration it is named (get and patch on that one object are its only rights there),
    and replaces it before it expires: the new certificate joins the caBundle first and is served
    only after the API server had time to see it.
  * "files": cert-manager (or anyone) writes tls.crt/tls.key into a mounted Secret and injects the
    CA into the configuration; the operator reloads the files when their content changes.
failurePolicy is Ignore: when the operator is down, or a certificate is not trusted yet, jobs are
still admitted on the schema and CEL alone, and the operator validates them again when it
reconciles; a webhook outage never blocks the cluster.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kubetune_operator import metrics, webhook_certs

log = logging.getLogger(__name__)

# How long a new caBundle is given to reach the API server before its certificate is served.
BUNDLE_PROPAGATION = datetime.timedelta(seconds=10)
# kopf re-reads the files it is given to restart its server when they change; the keeper below
# reloads the certificate in place instead, so kopf is told to (practically) never look again.
_KOPF_NEVER_RECHECKS = 10.0 ** 9


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclass
class OperatorCertificates:
    """Certificates the operator issues and publishes itself; `tick` is called every few seconds.

    publish(caBundle) -> bool writes the configuration's caBundle (False: it could not, and the
    keeper tries again on the next tick without changing what it serves).
    """
    dns_names: list[str]
    lifetime: datetime.timedelta
    publish: Callable[[str], bool]
    serving: webhook_certs.ServingCertificate | None = None
    pending: webhook_certs.ServingCertificate | None = None
    pending_since: datetime.datetime | None = None
    published: bool = False

    def first(self, now: datetime.datetime) -> webhook_certs.ServingCertificate:
        self.serving = webhook_certs.issue(self.dns_names, self.lifetime, now)
        self.published = self.publish(webhook_certs.ca_bundle(self.serving))
        return self.serving

    def tick(self, now: datetime.datetime) -> webhook_certs.ServingCertificate | None:
        """The certificate to serve from now on, or None to keep the current one."""
        if not self.published:
            self.published = self.publish(webhook_certs.ca_bundle(self.serving, self.pending))
            return None
        if self.pending is not None:
            if now - self.pending_since < BUNDLE_PROPAGATION:
                return None
            self.serving, self.pending, self.pending_since = self.pending, None, None
            return self.serving
        if self.serving.due_for_rotation(now):
            successor = webhook_certs.issue(self.dns_names, self.lifetime, now)
            # The old certificate stays trusted until the next rotation: a request already on its
            # way with the old bundle still verifies.
            if self.publish(webhook_certs.ca_bundle(self.serving, successor)):
                self.pending, self.pending_since = successor, now
            else:
                log.warning("could not publish the webhook's next certificate; serving the current one "
                            "(valid until %s) and trying again", self.serving.not_after.isoformat())
        return None


@dataclass
class FileCertificates:
    """Certificates someone else writes (cert-manager into a mounted Secret); reloaded on change."""
    directory: Path
    digest: str = field(default="")

    @property
    def certfile(self) -> Path:
        return self.directory / "tls.crt"

    @property
    def keyfile(self) -> Path:
        return self.directory / "tls.key"

    def changed(self) -> bool:
        try:
            digest = hashlib.sha256(self.certfile.read_bytes() + self.keyfile.read_bytes()).hexdigest()
        except OSError as err:  # a Secret volume mid-update, or not mounted yet: keep serving
            log.warning("cannot read the webhook certificate in %s: %s", self.directory, err)
            return False
        changed, self.digest = digest != self.digest, digest
        return changed


class CertificateKeeper:
    """Owns the TLS context the webhook server serves with, and keeps a valid certificate in it."""

    def __init__(self, source: OperatorCertificates | FileCertificates, cert_dir: Path,
                 check_every: float, clock: Callable[[], datetime.datetime] = _now):
        self.source, self.cert_dir, self.check_every, self.clock = source, cert_dir, check_every, clock
        self.context = ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH)
        # The first pair is the one kopf was given (kept); each later pair replaces the one before.
        self.certfile, self.keyfile = self._start()
        self._rotated: tuple[Path, Path] | None = None

    def _start(self) -> tuple[Path, Path]:
        if isinstance(self.source, FileCertificates):
            self.source.changed()
            self._load(self.source.certfile, self.source.keyfile)
            return self.source.certfile, self.source.keyfile
        return self._serve(self.source.first(self.clock()))

    def _serve(self, certificate: webhook_certs.ServingCertificate) -> tuple[Path, Path]:
        """Write CERTIFICATE under its own names (the files kopf was given stay as they are) and
        load it: connections from now on get it, open ones keep theirs."""
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        stamp = certificate.not_before.strftime("%Y%m%dT%H%M%S%f")
        certfile, keyfile = self.cert_dir / f"serving-{stamp}.crt", self.cert_dir / f"serving-{stamp}.key"
        keyfile.touch(mode=0o600)
        keyfile.write_bytes(certificate.key_pem)
        certfile.write_bytes(certificate.certificate_pem)
        self._load(certfile, keyfile)
        return certfile, keyfile

    def _load(self, certfile: Path, keyfile: Path) -> None:
        self.context.load_cert_chain(str(certfile), str(keyfile))
        expires = webhook_certs.expiry(certfile.read_bytes())
        metrics.WEBHOOK_CERTIFICATE_EXPIRY.set(expires.timestamp())
        log.info("webhook serving a certificate valid until %s", expires.isoformat())

    async def check(self) -> None:
        """One look: rotate or reload when due. The context changes on the event loop that serves
        the webhook, so never under a handshake in another thread."""
        if isinstance(self.source, FileCertificates):
            if self.source.changed():
                self._load(self.source.certfile, self.source.keyfile)
            return
        # tick may call the API server: in a worker thread, so the loop keeps serving meanwhile.
        successor = await asyncio.to_thread(self.source.tick, self.clock())
        if successor is not None:
            served = self._serve(successor)
            for old in self._rotated or ():  # no key lingers on disk once it is no longer served
                old.unlink(missing_ok=True)
            self._rotated = served

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_every)
            try:
                await self.check()
            except Exception:  # a bad file or a failed call never stops the keeper: the old certificate still serves
                log.exception("webhook certificate check failed")


def ca_bundle_publisher(configuration: str) -> Callable[[str], bool]:
    """publish(caBundle): set the caBundle of every webhook in the ValidatingWebhookConfiguration
    CONFIGURATION (the chart's; the operator may get and patch that one object only)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    def publish(bundle: str) -> bool:
        api = client.AdmissionregistrationV1Api()
        try:
            current = api.read_validating_webhook_configuration(configuration)
            patch = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
                     for i in range(len(current.webhooks or []))]
            if not patch:
                log.warning("ValidatingWebhookConfiguration %s has no webhooks to trust the certificate", configuration)
                return False
            api.patch_validating_webhook_configuration(configuration, patch)
        except ApiException as err:
            log.warning("cannot publish the webhook certificate in ValidatingWebhookConfiguration %s: %s %s "
                        "(is the chart's configuration there, and may the operator patch it?)",
                        configuration, err.status, err.reason)
            return False
        log.info("published the webhook certificate in ValidatingWebhookConfiguration %s", configuration)
        return True

    return publish


def configure_server(settings, config) -> CertificateKeeper:
    """Serve admission reviews on the pod's address with a kept certificate. CONFIG is the
    operator's Settings; kopf manages no webhook configuration (the chart owns it)."""
    import kopf

    cert_dir = Path(config.webhook_cert_dir)
    if config.webhook_certificates == "files":
        source = FileCertificates(cert_dir)
    else:
        source = OperatorCertificates(
            dns_names=list(config.webhook_dns_names),
            lifetime=datetime.timedelta(seconds=config.webhook_certificate_lifetime_seconds),
            publish=ca_bundle_publisher(config.webhook_configuration))
    keeper = CertificateKeeper(source, cert_dir, check_every=config.webhook_check_seconds)
    settings.admission.server = kopf.WebhookServer(
        addr=config.webhook_address, port=config.webhook_port, context=keeper.context,
        certfile=str(keeper.certfile), pkeyfile=str(keeper.keyfile), file_check_interval=_KOPF_NEVER_RECHECKS)
    settings.admission.managed = None
    return keeper
