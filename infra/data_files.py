"""Data files (data.prompts_path, data.eval_paths, `spillover eval --data`): a local path, a file:// URL, or a file of a
Hugging Face Hub repo, `hf://datasets/ORG/NAME[@REVISION]/FILE` (JSON Lines or Parquet; the grammar of
huggingface_hub's HF URIs, which HfFileSystem reads too).

A Hub file is fetched by huggingface_hub's hf_hub_download into its cache (HF_HOME, HF_HUB_CACHE), the cache that
models by Hub id use and `hf download --repo-type dataset ORG/NAME FILE` fills: the cache first, HF_HUB_OFFLINE
honoured, a download when online. (HfFileSystem, fsspec's `hf://`, reads the same files but keeps no copy on disk and
asks the Hub on every read, so an offline node could not read them.) The driver fetches every data file once, before
any actor starts (`pin_hub_data`), and the run's config names the commit each was read at
(hf://datasets/ORG/NAME@COMMIT/FILE): a resumed run and `spillover eval RUN_DIR` read those bytes from the cache even
after the data set changed on the Hub.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import unquote

__all__ = ["DataFile", "DataFileError", "HubFile", "data_file", "is_hub_path", "parse_hub_path", "pin_hub_data"]

HUB_SCHEME = "hf://"
# hf://TYPE/ORG/NAME[@REVISION]/FILE. A revision that holds '/' is a special ref (refs/pr/N, refs/convert/NAME, as
# huggingface_hub parses them) or is written with %2F; FILE is one file (a wildcard would name several).
HUB_PATH = re.compile(r"^hf://(?P<kind>datasets|models)/(?P<repo>[\w.-]+/[\w.-]+)"
                      r"(?:@(?P<revision>refs/(?:pr/\d+|convert/[\w.-]+)|[^/]+))?/(?P<file>[^*?\[\]]+)$")
SPECIAL_REF = re.compile(r"^refs/(?:pr/\d+|convert/[\w.-]+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
EXPECTED = "expected hf://datasets/ORG/NAME[@REVISION]/FILE, one JSON Lines or Parquet file of a Hub data set"


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


def data_file(path: str | os.PathLike, setting: str = "data.prompts_path") -> DataFile:
    """The file `setting` names, on this machine: a local path or file:// URL as it is (whether it exists is the
    reader's to say, with its line numbers), a Hub path fetched into huggingface_hub's cache. A DataFile passes as
    it is."""
    if isinstance(path, DataFile):
        return path
    source = os.fspath(path)
    if is_hub_path(source):
        return fetch_hub_file(source, setting)
    if source.startswith("file://"):
        return DataFile(source, Path(source[len("file://"):]), source)
    if "://" in source:
        raise DataFileError(f"{setting}={source!r}: data files are read from a local path, a file:// URL or the "
                            f"Hugging Face Hub ({EXPECTED}); copy it to this machine or publish it on the Hub")
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


def pin_hub_data(cfg):
    """cfg (a RunConfig) with every Hub file of data.prompts_path and data.eval_paths fetched (once: the driver calls
    this before any actor starts) and named at the commit it was read at."""
    data = cfg.data
    update = {}
    if is_hub_path(data.prompts_path):
        update["prompts_path"] = data_file(data.prompts_path, "data.prompts_path").pinned
    if any(is_hub_path(path) for path in data.eval_paths.values()):
        update["eval_paths"] = {key: data_file(path, f"data.eval_paths.{key}").pinned if is_hub_path(path) else path
                                for key, path in data.eval_paths.items()}
    return cfg.model_copy(update={"data": data.model_copy(update=update)}) if update else cfg
