"""Stored formats carry their name and version as one tag, "<name>/<version>" (e.g. "spillover-checkpoint/1").
A release reads exactly the version it writes: anything else is refused with one error that names the file, the
version found and the version this release reads (no reader for older layouts is kept)."""
from __future__ import annotations


class FormatVersionError(ValueError):
    """A stored file holds a format version this release does not read."""


def format_tag(name: str, version: int) -> str:
    return f"{name}/{version}"


def check_format_version(found: object, name: str, version: int, where: str) -> None:
    """Raise FormatVersionError unless `found` (the tag read from `where`, a file's URL) is name/version."""
    expected = format_tag(name, version)
    if found == expected:
        return
    prefix = f"{name}/"
    found_version = found[len(prefix):] if isinstance(found, str) and found.startswith(prefix) else None
    if found_version is None:
        seen = "no format tag" if found is None else f"format tag {found!r}"
        raise FormatVersionError(f"{where} has {seen}, not a {name} one; this release reads {name} version "
                                 f"{version} ({expected!r})")
    by = ""
    if found_version.isdigit():
        by = " (written by a newer release)" if int(found_version) > version else " (written by an older release)"
    raise FormatVersionError(f"{where} has {name} format version {found_version}{by}; this release reads version "
                             f"{version} only: use the release that wrote it")
