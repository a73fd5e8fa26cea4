"""The control plane's PKI and kubeconfigs, made once per state directory with openssl.

One CA signs the API server's serving certificate (valid for 127.0.0.1, localhost and the
in-cluster names pods use), the client certificates (Kubernetes reads a client's user from the
CN and its groups from O) and the webhook serving certificate that JobSet, Trainer and Kueue
present on 127.0.0.1 (the API server calls their webhooks by URL and trusts this CA through the
caBundle). A separate RSA key pair signs service-account tokens. Each file is made once; a state
directory from an older version gets only what it lacks.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

# Client identities: file stem -> (user, groups). system:masters bypasses RBAC, so only the
# admin and the control plane's own controllers (host processes, in place of the Deployments
# whose RBAC their charts would install) hold it; pods get service-account tokens instead.
CLIENTS = {
    "admin": ("kubetune:admin", ["system:masters"]),
    "controller-manager": ("system:kube-controller-manager", ["system:masters"]),
    "training-operator": ("kubetune:training-operator", ["system:masters"]),
    "jobset": ("kubetune:jobset-controller", ["system:masters"]),
    "trainer": ("kubetune:trainer-controller-manager", ["system:masters"]),
    "kueue": ("kubetune:kueue-controller-manager", ["system:masters"]),
    "kubelet": ("kubetune:process-kubelet", ["system:masters"]),
}

SERVING_KEY_USAGE = "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
CLIENT_KEY_USAGE = "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n"
# The only client the kubelet's API answers (kubelet_api.py): the API server, which presents this
# certificate (--kubelet-client-certificate) when it forwards `kubectl logs`. It holds no RBAC rights.
KUBELET_CLIENT = "kube-apiserver-kubelet-client"

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
    """Create the CA, serving, client and service-account keys that do not exist yet."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "3650", "-subj", "/CN=kubetune-dev-ca", cwd=pki)
    if not (pki / "apiserver.crt").exists():
        sans = ",".join(["IP:127.0.0.1", "IP:127.2.0.1"] + [f"DNS:{n}" for n in SERVING_NAMES])
        _sign(pki, "apiserver", "/CN=kube-apiserver", f"subjectAltName={sans}\n{SERVING_KEY_USAGE}")
    if not (pki / "kubelet-serving.crt").exists():  # the kubelet's API, which the API server calls
        _sign(pki, "kubelet-serving", "/CN=kubetune-dev", f"subjectAltName=IP:127.0.0.1\n{SERVING_KEY_USAGE}")
    if not (pki / f"{KUBELET_CLIENT}.crt").exists():  # the API server's identity towards the kubelet
        _sign(pki, KUBELET_CLIENT, f"/CN={KUBELET_CLIENT}", CLIENT_KEY_USAGE)
    if not (pki / "webhooks.crt").exists():
        _sign(pki, "webhooks", "/CN=kubetune-dev-webhooks",
              f"subjectAltName=IP:127.0.0.1,DNS:localhost\n{SERVING_KEY_USAGE}")
    for stem, (user, groups) in CLIENTS.items():
        if not (pki / f"{stem}.crt").exists():
            subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
            _sign(pki, stem, subject, CLIENT_KEY_USAGE)
    if not (pki / "sa.pub").exists():
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def serving_cert_dir(pki: Path, dest: Path) -> Path:
    """DEST holding the webhook certificate under the names controller-runtime reads (tls.crt,
    tls.key) and the CA (ca.crt); used as each controller's webhook and metrics certificate dir."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, source in (("tls.crt", "webhooks.crt"), ("tls.key", "webhooks.key"), ("ca.crt", "ca.crt")):
        content = (pki / source).read_bytes()
        if not (dest / name).exists() or (dest / name).read_bytes() != content:
            (dest / name).write_bytes(content)
            (dest / name).chmod(0o600)
    return dest


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
