"""Data files (data.prompts_path, data.eval_paths, `spillover eval --data`): a local path, a file:// URL, a file of a
Hugging Face Hub repo, `hf://datasets/ORG/NAME[@REVISION]/FILE` (JSON Lines or Parquet; the grammar of
huggingface_hub's HF URIs, which HfFileSystem reads too), or an S3 object, `s3://BUCKET/KEY`.

A Hub file is fetched by huggingface_hub's hf_hub_download into its cache (HF_HOME, HF_HUB_CACHE), the cache that
models by Hub id use and `hf download --repo-type dataset ORG/NAME FILE` fills: the cache first, HF_HUB_OFFLINE
honoured, a download when online. (HfFileSystem, fsspec's `hf://`, reads the same files but keeps no copy on disk and
asks the Hub on every read, so an offline node could not read them.) The driver fetches every data file once, before
any actor starts (`pin_data`), and the run's config names the commit each was read at
(hf://datasets/ORG/NAME@COMMIT/FILE): a resumed run and `spillover eval RUN_DIR` read those bytes from the cache even
after the data set changed on the Hub.

An S3 object is read through s3fs with the run's storage settings (storage.endpoint_url, region and credentials, or
the AWS_* environment: infra/storage/store.py, whose errors never show a secret) and copied into data.cache_dir, one
copy per version of the object (its ETag), so it is downloaded again only when it changed. The driver fetches it in
`pin_data`; the rest of that process (the prompts, the eval sets read mid-run) reads the copy without asking S3
again. Its name stays the s3:// path: readers' messages name it and its line.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

__all__ = ["DataFile", "DataFileError", "HubFile", "data_file", "is_hub_path", "is_s3_path", "parse_hub_path",
           "pin_data"]
log = logging.getLogger(__name__)

HUB_SCHEME = "hf://"
# hf://TYPE/ORG/NAME[@REVISION]/FILE. A revision that holds '/' is a special ref (refs/pr/N, refs/convert/NAME, as
# huggingface_hub parses them) or is written with %2F; FILE is one file (a wildcard would name several).
HUB_PATH = re.compile(r"^hf://(?P<kind>datasets|models)/(?P<repo>[\w.-]+/[\w.-]+)"
                      r"(?:@(?P<revision>refs/(?:pr/\d+|convert/[\w.-]+)|[^/]+))?/(?P<file>[^*?\[\]]+)$")
SPECIAL_REF = re.compile(r"^refs/(?:pr/\d+|convert/[\w.-]+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
EXPECTED = "expected hf://datasets/ORG/NAME[@REVISION]/FILE, one JSON Lines or Parquet file of a Hub data set"
S3_SCHEMES = ("s3://", "s3a://")  # s3a: as storage.url and model.path accept it
S3_PATH = re.compile(r"^s3a?://(?P<bucket>[^/@:]+)/(?P<key>.*[^/])$")
EXPECTED_S3 = "expected s3://BUCKET/KEY, one JSON Lines or Parquet object"
S3_CHECK_DEADLINE_S = 10.0  # the first request's retries, as check_storage's: a server down this long is named then
_fetched: dict[tuple[str, str], "DataFile"] = {}  # (s3:// path, its cache folder) -> the copy this process fetched


class DataFileError(ValueError):
    """A data file that cannot be had: one line naming the setting, the file and the fix."""


@dataclass(frozen=True)
class DataFile(os.PathLike):
    """A data file as the run's config names it (str(): what error messages say) and where its bytes lie on this
    machine (os.fspath(): what open() and pyarrow read), so a reader's messages name the Hub path, not the cache."""
    source: str     # as configured
    local: Path     # the file read
    pinned: str     # as the run's config records it: a Hub file at the commit it was read at; else source

    def __fspath__(self) -> str:
        return str(self.local)

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return repr(self.source)


@dataclass(frozen=True)
class HubFile:
    repo_type: str          # dataset | model (huggingface_hub's names)
    repo_id: str
    revision: str | None    # None: the repo's default branch (main)
    filename: str

    def uri(self, revision: str | None) -> str:
        """hf://TYPE/ORG/NAME[@REVISION]/FILE."""
        if revision and "/" in revision and not SPECIAL_REF.match(revision):
            revision = revision.replace("/", "%2F")
        return f"{HUB_SCHEME}{self.repo_type}s/{self.repo_id}{f'@{revision}' if revision else ''}/{self.filename}"


def is_hub_path(path) -> bool:
    return isinstance(path, str) and path.startswith(HUB_SCHEME)


def parse_hub_path(path: str, setting: str) -> HubFile:
    """hf://datasets/ORG/NAME[@REVISION]/FILE -> its parts; anything else under hf:// is one error naming setting."""
    match = HUB_PATH.match(path)
    if match is None:
        raise DataFileError(f"{setting}={path!r} is not a Hub file path: {EXPECTED}")
    revision = unquote(match["revision"]) if match["revision"] else None
    return HubFile(match["kind"][:-1], match["repo"], revision, match["file"])


def is_s3_path(path) -> bool:
    return isinstance(path, str) and path.startswith(S3_SCHEMES)


def data_file(path: str | os.PathLike, setting: str = "data.prompts_path", cfg=None, *,
              recheck: bool = False) -> DataFile:
    """The file `setting` names, on this machine: a local path or file:// URL as it is (whether it exists is the
    reader's to say, with its line numbers), a Hub path fetched into huggingface_hub's cache, an S3 object copied into
    data.cache_dir with cfg's (a RunConfig's) storage settings (None: the defaults and the AWS_* environment); an S3
    object this process already fetched is not asked for again unless `recheck`. A DataFile passes as it is."""
    if isinstance(path, DataFile):
        return path
    source = os.fspath(path)
    if is_hub_path(source):
        return fetch_hub_file(source, setting)
    if is_s3_path(source):
        return fetch_s3_file(source, setting, cfg, recheck=recheck)
    if source.startswith("file://"):
        return DataFile(source, Path(source[len("file://"):]), source)
    if "://" in source:
        raise DataFileError(f"{setting}={source!r}: data files are read from a local path, a file:// URL, the "
                            f"Hugging Face Hub ({EXPECTED}) or S3 (s3://BUCKET/KEY); copy it to one of them")
    return DataFile(source, Path(source), source)


def fetch_hub_file(path: str, setting: str) -> DataFile:
    """A Hub file in huggingface_hub's cache (downloaded when not there and online) -> DataFile pinned at the commit
    it was read at. Every way it cannot be had is one DataFileError with the fix."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    hub = parse_hub_path(path, setting)
    named, kind = f"{setting}={path!r}", hub.repo_type.replace("dataset", "data set")
    revision = hub.revision or "main"
    download = (f"`hf download --repo-type {hub.repo_type} {hub.repo_id} {hub.filename}"
                f"{f' --revision {hub.revision}' if hub.revision else ''}`")
    try:
        local = Path(hf_hub_download(hub.repo_id, hub.filename, repo_type=hub.repo_type, revision=hub.revision))
    except GatedRepoError:
        raise DataFileError(f"{named}: {hub.repo_id} is a gated Hub repo: accept its terms on huggingface.co and log "
                            "in (`hf auth login`, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise DataFileError(f"{named}: {revision!r} is not a branch, tag or commit of the {kind} "
                            f"{hub.repo_id}") from None
    except RepositoryNotFoundError:
        raise DataFileError(f"{named}: there is no {kind} {hub.repo_id} on the Hub at {constants.ENDPOINT} (a "
                            "private one needs HF_TOKEN)") from None
    except LocalEntryNotFoundError:  # before EntryNotFoundError, its base: the Hub was not asked or not reached
        if constants.HF_HUB_OFFLINE:
            raise DataFileError(f"{named} is not in the cache at {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE=1: run "
                                f"{download} or unset HF_HUB_OFFLINE") from None
        raise DataFileError(f"{named} is not in the cache at {constants.HF_HUB_CACHE} and the Hub at "
                            f"{constants.ENDPOINT} cannot be reached: run {download} where it can, or give a local "
                            "copy") from None
    except EntryNotFoundError:
        raise DataFileError(f"{named}: the {kind} {hub.repo_id} has no file {hub.filename!r} at {revision}; its "
                            f"files: {hub_tree_url(hub, revision, constants.ENDPOINT)}") from None
    except HfHubHTTPError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataFileError(f"{named}: the Hub at {constants.ENDPOINT} refused it ({reason})") from None
    # the cache keeps a file at snapshots/<commit>/<filename>
    commit = local.parents[len(PurePosixPath(hub.filename).parts) - 1].name
    return DataFile(path, local, hub.uri(commit) if COMMIT.match(commit) else path)


def hub_tree_url(hub: HubFile, revision: str, endpoint: str) -> str:
    """The Hub's web page listing the repo's files at `revision`."""
    prefix = "" if hub.repo_type == "model" else f"{hub.repo_type}s/"
    return f"{endpoint}/{prefix}{hub.repo_id}/tree/{revision.replace('/', '%2F')}"


def fetch_s3_file(path: str, setting: str, cfg=None, *, recheck: bool = False) -> DataFile:
    """An S3 object -> its copy at <data.cache_dir>/<hash of server and path>/<ETag>/<file name>, downloaded when that
    version is not there yet. Every way it cannot be had is one DataFileError naming the setting and the fix."""
    from .config.run_config import DataConfig, StorageConfig
    from .storage.store import ObjectMissing, RetryPolicy, StorageError, open_store, s3_server

    parts = urlsplit(path)
    if parts.username or parts.password:
        shown = path.replace(parts.netloc, parts.hostname or "", 1)
        raise DataFileError(f"{setting}={shown!r} carries credentials; put them in storage.access_key_id / "
                            "storage.secret_access_key or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY instead")
    match = S3_PATH.match(path)
    if match is None:
        raise DataFileError(f"{setting}={path!r} is not an S3 object path: {EXPECTED_S3}")
    bucket, key = match["bucket"], match["key"]
    storage = cfg.storage if cfg is not None else StorageConfig()
    server = s3_server(storage)
    cache_dir = Path(cfg.data.cache_dir if cfg is not None else DataConfig().cache_dir).expanduser().absolute()
    folder = cache_dir / hashlib.sha256(f"{server}\n{bucket}/{key}".encode()).hexdigest()[:20]
    fetched = _fetched.get((path, str(folder)))
    if fetched is not None and not recheck and fetched.local.is_file():
        return fetched
    named = f"{setting}={path!r}"

    def refused(err: StorageError) -> DataFileError:
        if isinstance(err, ObjectMissing):
            return DataFileError(f"{named}: {server} has no object {key!r} in bucket {bucket!r}: upload the file "
                                 f"there or correct {setting}")
        return DataFileError(f"{named}: {' '.join(str(err).split())}")

    store = open_store(f"s3://{bucket}", storage, retry=RetryPolicy(deadline_s=S3_CHECK_DEADLINE_S, max_backoff_s=2.0))
    try:
        info = store.info(key)
    except StorageError as err:
        raise refused(err) from None
    if info.get("type") != "file":
        raise DataFileError(f"{named} is a folder of bucket {bucket!r}, not one object: {EXPECTED_S3}")
    version = s3_version(info)
    local = folder / version / PurePosixPath(key).name
    if not (local.is_file() and local.stat().st_size == info["size"]):
        local.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=local.parent, prefix=f".{local.name}.", suffix=".part")
        os.close(fd)
        try:
            # the default deadline: a download that fails late is retried longer than a first request
            download = open_store(f"s3://{bucket}", storage)
            download.get_file(key, part)
            # s3fs reads every range If-Match the ETag it saw when it opened the object: the bytes are one version,
            # this one if the object still has it
            after = download.info(key)
            if s3_version(after) != version or os.path.getsize(part) != info["size"]:
                raise DataFileError(f"{named} changed while it was read ({version} -> {s3_version(after)}): run "
                                    "again once its upload is done")
            os.replace(part, local)
        except StorageError as err:
            raise refused(err) from None
        finally:
            if os.path.exists(part):
                os.unlink(part)
        log.info("%s: %s (%d bytes, ETag %s) copied to %s", setting, path, info["size"], version, local)
    fetched = DataFile(path, local, path)
    _fetched[(path, str(folder))] = fetched
    return fetched


def s3_version(info: dict) -> str:
    """The name of an object's version in the cache: its ETag (a digest of its bytes), else its size and time."""
    etag = re.sub(r"[^0-9A-Za-z-]", "", str(info.get("ETag") or ""))
    return etag or re.sub(r"[^0-9A-Za-z-]", "-", f"{info['size']}-{info.get('LastModified', '')}")


def pin_data(cfg):
    """cfg (a RunConfig) with every remote file of data.prompts_path and data.eval_paths fetched, once: the driver
    calls this before any actor starts. A Hub file is named at the commit it was read at; an S3 object keeps its
    name, and this process reads the copy fetched here from then on."""
    data = cfg.data
    remote = {"data.prompts_path": data.prompts_path, **{f"data.eval_paths.{k}": v for k, v in data.eval_paths.items()}}
    for setting, path in remote.items():
        if is_s3_path(path):
            data_file(path, setting, cfg, recheck=True)
    update = {}
    if is_hub_path(data.prompts_path):
        update["prompts_path"] = data_file(data.prompts_path, "data.prompts_path").pinned
    if any(is_hub_path(path) for path in data.eval_paths.values()):
        update["eval_paths"] = {key: data_file(path, f"data.eval_paths.{key}").pinned if is_hub_path(path) else path
                                for key, path in data.eval_paths.items()}
    return cfg.model_copy(update={"data": data.model_copy(update=update)}) if update else cfg
