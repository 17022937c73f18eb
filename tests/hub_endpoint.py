"""A stand-in Hugging Face Hub on 127.0.0.1 for the real huggingface_hub client: `HF_ENDPOINT=hub.url` points it here.

It answers what hf_hub_download asks for one file, as the Hub answers it: HEAD, then GET, of
`/datasets/ORG/NAME/resolve/REVISION/FILE` (models without the `datasets/` prefix). A file comes with the headers the
client reads (X-Repo-Commit, ETag, Content-Length); a missing repo, revision or file is a 404 with the Hub's
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound), which huggingface_hub turns into its own errors.
huggingface_hub reads HF_ENDPOINT when it is imported, so the processes that use this endpoint start with it set.
"""
from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


class HubEndpoint:
    """Repos ("datasets/ORG/NAME" or "ORG/NAME") -> commits -> files; `requests` lists (method, path) served."""

    def __init__(self):
        self.commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> commit -> {file: bytes}
        self.branches: dict[str, dict[str, str]] = {}              # repo -> branch -> commit
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="hub-endpoint")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def commit(self, repo: str, files: dict[str, bytes]) -> str:
        """A new commit of `repo` holding `files`; main moves to it -> its hash."""
        with self._lock:
            commits = self.commits.setdefault(repo, {})
            sha = hashlib.sha1(f"{repo}#{len(commits)}".encode()).hexdigest()
            commits[sha] = dict(files)
            self.branches.setdefault(repo, {})["main"] = sha
        return sha

    def __enter__(self) -> "HubEndpoint":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def answer(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for a resolve/ URL path."""
        repo, sep, rest = unquote(path.split("?", 1)[0]).lstrip("/").partition("/resolve/")
        if not sep:
            return 404, {"X-Error-Message": f"not a resolve/ route: {path}"}, b""
        with self._lock:
            if repo not in self.commits:
                return 404, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b""
            revision, _, filename = rest.partition("/")
            commit = self.branches[repo].get(revision, revision)
            if commit not in self.commits[repo]:
                return 404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b""
            body = self.commits[repo][commit].get(filename)
        if body is None:
            return 404, {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found",
                         "X-Repo-Commit": commit}, b""
        return 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"',
                     "Content-Type": "application/octet-stream"}, body

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, send_body: bool) -> None:
                with hub._lock:
                    hub.requests.append((self.command, self.path))
                status, headers, body = hub.answer(self.path)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def do_HEAD(self):  # noqa: N802 -- http.server's names
                self._reply(send_body=False)

            def do_GET(self):  # noqa: N802
                self._reply(send_body=True)

            def log_message(self, *args):  # the test output is for the test's own lines
                pass

        return Handler
