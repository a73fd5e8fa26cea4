"""A local stand-in for the Hugging Face Hub's file API, for tests: no hub is reachable here.

It serves enough of the API that huggingface_hub, pointed at it with HF_ENDPOINT, resolves
revisions and downloads models: model info at a revision (GET /api/models/ORG/NAME/revision/REV),
the file listing (GET /api/models/ORG/NAME/tree/REV?recursive=...), and each file (HEAD and GET
/ORG/NAME/resolve/REV/PATH, with the X-Repo-Commit and ETag headers the client checks). Errors
carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, GatedRepo, EntryNotFound), which
the client turns into its typed exceptions. A gated model answers 401 without its token and 403
with a wrong one. Every GET of a file is counted, so a test can say how often each was downloaded.

It binds 127.0.0.1 only; use it as a context manager (or call stop()) so no test leaves it running.
"""
from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class StandInModel:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> content
    refs: dict[str, str] = field(default_factory=dict)                  # branch or tag -> commit
    token: str | None = None                                            # set: gated, this token opens it

    def commit_of(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


class HubStandIn:
    """The stand-in server: publish() models, then point HF_ENDPOINT at .endpoint."""

    def __init__(self):
        self.models: dict[str, StandInModel] = {}
        self.downloads: Counter[tuple[str, str]] = Counter()  # (repo id, path) -> GETs of the file
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        # A short poll: stop() returns within it (tests start and stop one per test).
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-stand-in", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def publish(self, repo_id: str, folder: Path, ref: str = "main", token: str | None = None) -> str:
        """Serve the files under folder as a new commit of repo_id, which ref (a branch or tag) then
        names; token makes the model gated. Returns the commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        model = self.models.setdefault(repo_id, StandInModel())
        # Salted: a commit never seen before, as on the hub, so no client cache of an earlier test holds it.
        digest.update(f"{repo_id}:{len(model.commits)}:{secrets.token_hex(8)}".encode())
        for name, content in files.items():
            digest.update(name.encode() + hashlib.sha1(content).digest())
        commit = digest.hexdigest()
        with self._lock:
            model.commits[commit] = files
            model.refs[ref] = commit
            model.token = token if token is not None else model.token
        return commit

    def downloads_of(self, repo_id: str) -> dict[str, int]:
        with self._lock:
            return {path: n for (repo, path), n in self.downloads.items() if repo == repo_id}

    def start(self) -> "HubStandIn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "HubStandIn":
        return self.start()

    def __exit__(self, *_) -> None:
        self.stop()

    def count(self, repo_id: str, path: str) -> None:
        with self._lock:
            self.downloads[(repo_id, path)] += 1


def _blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()  # as git names a blob


def _handler_for(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):  # quiet: tests read the counters
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _send(self, status: int, payload: bytes = b"", headers: dict | None = None, body: bool = True,
                  content_type: str = "application/json"):
            self.send_response(status)
            for name, value in {"Content-Type": content_type, "Content-Length": str(len(payload)),
                                **(headers or {})}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def _error(self, status: int, code: str, message: str, body: bool):
            self._send(status, json.dumps({"error": message}).encode(),
                       {"X-Error-Code": code, "X-Error-Message": message}, body)

        def _model(self, repo_id: str, body: bool) -> StandInModel | None:
            model = hub.models.get(repo_id)
            if model is None:
                self._error(404, "RepoNotFound", f"Repository not found: {repo_id}", body)
                return None
            if model.token is not None:
                given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if given != model.token:
                    status = 403 if given else 401
                    self._error(status, "GatedRepo", f"Access to model {repo_id} is restricted.", body)
                    return None
            return model

        def _commit(self, model: StandInModel, repo_id: str, revision: str, body: bool) -> str | None:
            commit = model.commit_of(revision)
            if commit is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision} in {repo_id}", body)
            return commit

        def _answer(self, body: bool):
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = "/".join(parts[2:4])
                rest = parts[4:]
                model = self._model(repo_id, body)
                if model is None:
                    return
                if not rest or rest[0] == "revision":
                    commit = self._commit(model, repo_id, rest[1] if len(rest) > 1 else "main", body)
                    if commit:
                        files = model.commits[commit]
                        info = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                "gated": "manual" if model.token else False,
                                "siblings": [{"rfilename": name} for name in files]}
                        self._send(200, json.dumps(info).encode(), body=body)
                    return
                if rest[0] == "tree" and len(rest) >= 2:
                    commit = self._commit(model, repo_id, rest[1], body)
                    if commit:
                        under = "/".join(rest[2:])
                        entries = [{"type": "file", "oid": _blob_id(content), "size": len(content), "path": name}
                                   for name, content in model.commits[commit].items()
                                   if not under or name.startswith(under.rstrip("/") + "/")]
                        self._send(200, json.dumps(entries).encode(), body=body)
                    return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                model = self._model(repo_id, body)
                commit = model and self._commit(model, repo_id, revision, body)
                if not commit:
                    return
                content = model.commits[commit].get(path)
                if content is None:
                    self._error(404, "EntryNotFound", f"{path} not found in {repo_id}@{commit}", body)
                    return
                if body:
                    hub.count(repo_id, path)
                self._send(200, content, {"X-Repo-Commit": commit, "ETag": f'"{_blob_id(content)}"'}, body,
                           content_type="application/octet-stream")
                return
            self._error(404, "EntryNotFound", f"the stand-in does not serve {self.path}", body)

    return Handler
