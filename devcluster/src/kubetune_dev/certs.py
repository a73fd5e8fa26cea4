"""The control plane's PKI and kubeconfigs, made once per state directory with openssl.

One CA signs the API server's serving certificate (valid for 127.0.0.1, localhost and the
in-cluster names pods use) and the client certificates; Kubernetes reads a client's user from
the CN and its groups from O. A separate RSA key pair signs service-account tokens.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

# Client identities: file stem -> (user, groups). system:masters bypasses RBAC, so only the
# admin, the controller manager, the training operator and the process kubelet hold it.
CLIENTS = {
    "admin": ("kubetune:admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", ["system:masters"]),
    "training-operator": ("kubetune:training-operator", ["system:masters"]),
    "kubelet": ("kubetune:process-kubelet", ["system:masters"]),
}

SERVING_NAMES = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 "kubernetes.default.svc.cluster.local"]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _sign(pki: Path, stem: str, subject: str, extensions: str) -> None:
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}.key",
             "-out", f"{stem}.csr", "-subj", subject, cwd=pki)
    (pki / f"{stem}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", f"{stem}.ext",
             "-out", f"{stem}.crt", cwd=pki)
    (pki / f"{stem}.csr").unlink()
    (pki / f"{stem}.ext").unlink()


def ensure_pki(pki: Path) -> None:
    """Create the CA, serving, client and service-account keys unless they exist."""
    if (pki / "done").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "3650", "-subj", "/CN=kubetune-dev-ca", cwd=pki)
    sans = ",".join(["IP:127.0.0.1", "IP:10.0.0.1"] + [f"DNS:{n}" for n in SERVING_NAMES])
    _sign(pki, "apiserver", "/CN=kube-apiserver",
          f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    for stem, (user, groups) in CLIENTS.items():
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
        _sign(pki, stem, subject,
              "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
    (pki / "done").touch()


def write_kubeconfig(path: Path, server: str, pki: Path, client: str) -> None:
    """A kubeconfig for CLIENT (a key of CLIENTS) that trusts our CA."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kubetune-dev",
                      "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": client,
                   "user": {"client-certificate": str(pki / f"{client}.crt"),
                            "client-key": str(pki / f"{client}.key")}}],
        "contexts": [{"name": "kubetune-dev", "context": {"cluster": "kubetune-dev", "user": client}}],
        "current-context": "kubetune-dev",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
