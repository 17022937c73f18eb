"""Models from object storage (`model.path = s3://bucket/prefix`): every node of the Ray cluster copies the HF
folder once into its local cache (`model.cache_dir`) and checks each file's sha256, so a multi-node cluster needs
no shared file system; learners and engines then read the same local path on every node.

The driver's node stages first. The expected digests come from the folder's `sha256.json` ({file: hex}) when it
has one, and are computed while downloading otherwise; every other node then stages against the driver's digests,
so all nodes serve the same bytes. A cached copy is used only when its files still hash to the expected digests;
a torn or edited copy is fetched again. Files are written to a temporary folder renamed into place, under a file
lock, so concurrent stagers on one node download once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from filelock import FileLock

from ..config.run_config import StorageConfig

__all__ = ["SOURCE_DIGESTS", "STAGED_MANIFEST", "is_remote_model", "stage_model", "stage_on_other_nodes"]
log = logging.getLogger(__name__)
SOURCE_DIGESTS = "sha256.json"           # optional, in the remote folder: {relative file name: sha256 hex}
STAGED_MANIFEST = "spillover-staged.json"  # in the cached folder: {"url", "files": {name: sha256 hex}}


def is_remote_model(path: str | None) -> bool:
    return bool(path) and urlsplit(str(path)).scheme in ("s3", "s3a")


def cache_folder(url: str, cache_dir: str) -> Path:
    return Path(cache_dir).expanduser().absolute() / hashlib.sha256(url.encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


def stage_model(url: str, storage: StorageConfig, cache_dir: str,
                expected: dict[str, str] | None = None) -> tuple[str, dict[str, str], bool]:
    """The model folder at `url` in this node's cache -> (local path, {file: sha256}, downloaded?)."""
    target = cache_folder(url, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        cached = _verified_copy(target, url, expected)
        if cached is not None:
            return str(target), cached, False
        return str(target), _download(url, storage, target, expected), True


def _verified_copy(target: Path, url: str, expected: dict[str, str] | None) -> dict[str, str] | None:
    try:
        files = json.loads((target / STAGED_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None
    if expected is not None and files != expected:
        return None
    for name, digest in files.items():
        if not (target / name).is_file() or file_sha256(target / name) != digest:
            log.warning("cached model %s: %s does not match its sha256; fetching %s again", target, name, url)
            return None
    return files


def _download(url: str, storage: StorageConfig, target: Path, expected: dict[str, str] | None) -> dict[str, str]:
    from .store import open_store

    store = open_store(url, storage)
    names = store.list_all()
    if "config.json" not in names:
        raise FileNotFoundError(f"model.path {store.url!r} holds no config.json (found {names[:5]}): upload the HF "
                                "folder there (config.json, *.safetensors, tokenizer files)")
    want, source = expected, "the driver's copy"
    if want is None and SOURCE_DIGESTS in names:
        want, source = json.loads(store.get_bytes(SOURCE_DIGESTS)), f"{store.key_url(SOURCE_DIGESTS)}"
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        digests = {}
        for name in (n for n in names if n != SOURCE_DIGESTS):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            digests[name] = store.get_file(name, str(staging / name))
            if want is not None and want.get(name) != digests[name]:
                raise ValueError(f"model.path {store.key_url(name)}: sha256 {digests[name][:16]}... differs from "
                                 f"{source} ({str(want.get(name))[:16]}...): the upload is torn or was changed; "
                                 "upload the folder again (and its sha256.json)")
        if want is not None and set(want) != set(digests):
            raise ValueError(f"model.path {store.url!r}: files {sorted(set(want) ^ set(digests))[:5]} are in only "
                             f"one of the folder and {source}; upload the folder again")
        (staging / STAGED_MANIFEST).write_text(json.dumps({"url": url, "files": digests}, indent=1))
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("staged %s into %s (%d files)", store.url, target, len(digests))
    return digests


def stage_on_other_nodes(path: str, storage: StorageConfig) -> list[dict]:
    """A model staged here (`path`, from stage_model) staged on every other alive node of the joined Ray cluster,
    against this copy's digests, into the same (absolute, expanded here) path. -> one {node_id, downloaded} per other
    node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    manifest = json.loads((Path(path) / STAGED_MANIFEST).read_text())
    here = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != here]
    stage = ray.remote(num_cpus=0, max_retries=0)(stage_model)
    cache_dir = str(Path(path).parent)
    staged = ray.get([stage.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                      .remote(manifest["url"], storage, cache_dir, manifest["files"]) for node in others])
    return [{"node_id": node, "downloaded": downloaded} for node, (_, _, downloaded) in zip(others, staged)]
