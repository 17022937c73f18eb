"""Checkpoints as objects under `<store root>/ckpt-<iteration:08d>/`, made to survive crashes and bit rot.

Layout of one checkpoint:
    tensors/<group>-<shard:05d>.safetensors   e.g. policy weights, flattened optimizer state
    arrays/<group>-<shard:05d>.safetensors    e.g. the dock snapshot (numpy arrays)
    meta.json                                 JSON-able dict: iteration, versions, cursor, RNG, config...
    manifest.json                             written LAST: format version, size and sha256 of every object above

A checkpoint without a readable manifest whose objects all match it does not exist: loading skips it
(with a warning naming the bad object) and falls back to the previous one. A manifest of another format version
is refused outright (FormatVersionError): falling back would roll the run back silently. Nothing is pickled.
"""
from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from . import checkpoint_objects as objects_io
from .checkpoint_objects import ARRAYS, TENSORS, ObjectFormatError
from .format_version import check_format_version, format_tag
from ..hooks import hook_point
from .checkpoint_list import MANIFEST, CheckpointInfo, checkpoint_name, list_checkpoints
from .errors import CheckpointError
from .store import ObjectInfo, ObjectMissing, Store

log = logging.getLogger("spillover.checkpoint")

CHECKPOINT_FORMAT = "spillover-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1  # the manifest layout this release writes and the only one it reads
META = "meta.json"
MAX_OBJECT_BYTES = 256 << 20  # shard size: bounds retry cost and memory per in-flight object
SMALL_BYTES = 16 << 20  # a checkpoint below this counts as small for choosing threads
_GROUP = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass
class CheckpointState:
    """Everything needed to resume. tensors: group -> name -> tensor (e.g. {"policy": ..., "optimizer": ...});
    arrays: group -> name -> ndarray (e.g. {"dock": ...}); meta: JSON-able (RNG, cursor, config, ...);
    url: where it was loaded from (None: built in memory), for errors about what it holds."""
    iteration: int
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    url: str | None = None


def _delete_checkpoint(store: Store, name: str) -> None:
    store.delete_object(f"{name}/{MANIFEST}")  # first, so a half-deleted checkpoint never looks complete
    store.delete(name)


def prune(store: Store, keep: int, newest: int | None = None) -> list[str]:
    """Keep the newest `keep` complete checkpoints up to iteration `newest` (the one just written; None: the newest
    complete one); delete older ones, incomplete leftovers older than it, and every checkpoint after it: those were
    left by a run that went back to an earlier checkpoint (they were unusable then), and neither may take a kept
    place from a good one nor be resumed from later. Returns the deleted names."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (storage.keep_checkpoints); got {keep}")
    infos = list_checkpoints(store)
    after_written = newest is not None
    if newest is None:
        done = [i.iteration for i in infos if i.complete]
        if not done:
            return []
        newest = done[-1]
    done_by_newest = [i for i in infos if i.complete and i.iteration <= newest]
    kept = {i.name for i in done_by_newest[-keep:]}
    doomed = [i.name for i in infos if i.name not in kept
              and (i.complete or i.iteration < newest or (after_written and i.iteration > newest))]
    for name in doomed:
        _delete_checkpoint(store, name)
        log.info("pruned checkpoint %s", store.key_url(name))
    return doomed


_SCALAR_TYPES = {str, int, float, bool, type(None)}


def _first_non_json(value, path: str = "meta") -> str | None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path} key {k!r} (keys must be strings)"
            bad = _first_non_json(v, f"{path}.{k}")
            if bad:
                return bad
        return None
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= _SCALAR_TYPES:  # e.g. an RNG state of 625 ints, checked in C
            return None
        return next((b for i, v in enumerate(value) if (b := _first_non_json(v, f"{path}[{i}]"))), None)
    ok = value is None or isinstance(value, (str, int, float, bool))
    return None if ok else f"{path} ({type(value).__name__})"


def plan_objects(state: CheckpointState, max_object_bytes: int) -> tuple[dict[str, tuple[str, dict]], dict]:
    """key -> (kind, {name: tensor or array}) of each object to write, and the manifest's group index:
    kind -> group -> [keys]."""
    objects: dict[str, tuple[str, dict]] = {}
    groups: dict = {TENSORS: {}, ARRAYS: {}}
    for kind, groups_in, prepare in ((TENSORS, state.tensors, objects_io.tensors_for_save),
                                     (ARRAYS, state.arrays, objects_io.arrays_for_save)):
        for group, values in groups_in.items():
            if not _GROUP.match(group):
                raise CheckpointError(f"{kind} group name {group!r} must match {_GROUP.pattern}")
            try:
                values = prepare(group, values)
            except ObjectFormatError as err:
                raise CheckpointError(f"checkpoint {kind}: {err}") from None
            keys = []
            for i, shard in enumerate(objects_io.split_shards(values, max_object_bytes)):
                key = f"{kind}/{group}-{i:05d}.safetensors"
                objects[key] = (kind, shard)
                keys.append(key)
            groups[kind][group] = keys
    return objects, groups


def _auto_workers(store: Store, total_bytes: int) -> int:
    """Threads moving objects (each hashes what it moves). Local: none for small checkpoints (thread costs
    dominate), else 4 so hashing spreads over cores. S3: 4 for small objects (latency bound); 2 for large
    ones, whose parts s3fs already uploads 10 at a time."""
    if store.is_local:
        return 1 if total_bytes < SMALL_BYTES else 4
    return 4 if total_bytes < SMALL_BYTES else 2


def _run_all(calls: dict, workers: int) -> dict:
    """{key: (fn, *args)} -> {key: fn(*args)} on `workers` threads; the first error cancels what has not
    started (so a storage outage fails once, not once per object) and is raised."""
    if workers <= 1 or len(calls) <= 1:
        return {key: call[0](*call[1:]) for key, call in calls.items()}
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        futures = {key: pool.submit(*call) for key, call in calls.items()}
        return {key: fut.result() for key, fut in futures.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _manifest_json(manifest: dict) -> bytes:
    """Indented by hand, one object per line: json.dumps(indent=...) runs the pure-Python encoder."""
    def line(value) -> str:
        return json.dumps(value, separators=(",", ":"))
    objects = ",\n  ".join(f"{line(k)}: {line(v)}" for k, v in manifest["objects"].items())
    rest = [f"{line(k)}: {line(v)}" for k, v in manifest.items() if k != "objects"]
    return ("{\n " + ",\n ".join(rest) + ',\n "objects": {\n  ' + objects + "\n }\n}\n").encode()


def save_checkpoint(store: Store, state: CheckpointState, keep: int | None = None, *,
                    max_object_bytes: int = MAX_OBJECT_BYTES, workers: int | None = None,
                    written: list[dict] | None = None) -> str:
    """Write `state` as ckpt-<iteration>/ (objects first, manifest last), then prune to `keep` complete
    checkpoints when given. Returns the checkpoint's URL. Raises StorageError when storage stays down past
    the retry deadline; the partial prefix is then not a checkpoint.

    written: objects others already wrote under checkpoint_name(iteration)/ (e.g. each learner rank its own
    shards), [{"objects": {key: {size, sha256}}, "groups": {kind: {group: [keys]}}}]: the manifest lists them
    too, and loading verifies and decodes them like the rest."""
    bad = _first_non_json(state.meta)
    if bad:
        raise CheckpointError(f"checkpoint meta must be JSON-able; {bad} is not (convert it, e.g. tensors to lists)")
    meta_bytes = json.dumps(state.meta).encode()
    if store.contains_secret(meta_bytes.decode()):
        raise CheckpointError("checkpoint meta holds a storage credential; pass the config as "
                              "config.model_dump(mode='json') so secrets are masked")
    name = checkpoint_name(state.iteration)
    # An earlier attempt at this iteration needs no cleanup first: while objects are overwritten its old
    # manifest no longer verifies, and leftovers outside the new manifest go when prune drops the prefix.
    start = time.perf_counter()
    objects, groups = plan_objects(state, max_object_bytes)
    total = len(meta_bytes) + sum(objects_io.nbytes(v) for _, values in objects.values() for v in values.values())
    calls = {key: (objects_io.put_object, store, f"{name}/{key}", kind, values)
             for key, (kind, values) in objects.items()}
    calls[META] = (store.put_bytes, f"{name}/{META}", meta_bytes)
    try:
        infos: dict[str, ObjectInfo] = _run_all(calls, workers or _auto_workers(store, total))
    except ObjectFormatError as err:
        raise CheckpointError(f"checkpoint {store.key_url(name)}: {err}") from None
    hook_point("checkpoint_manifest", state.iteration)  # crash tests: every object written, no manifest yet
    listed = {k: {"size": i.size, "sha256": i.sha256} for k, i in infos.items()}
    for part in written or ():
        listed.update(part["objects"])
        for kind, named in part["groups"].items():
            groups.setdefault(kind, {}).update(named)
    manifest = {"format": format_tag(CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION), "iteration": state.iteration,
                "created_unix": time.time(), "groups": groups, "meta": META, "objects": listed}
    store.put_bytes(f"{name}/{MANIFEST}", _manifest_json(manifest))
    log.info("checkpoint %s written: %d objects, %.1f MB in %.2f s", store.key_url(name), len(infos), total / 1e6,
             time.perf_counter() - start)
    if keep is not None:
        prune(store, keep, newest=state.iteration)
    return store.key_url(name)


def _read_manifest(store: Store, name: str) -> dict:
    url = store.key_url(f"{name}/{MANIFEST}")
    try:
        manifest = json.loads(store.get_bytes(f"{name}/{MANIFEST}"))
        found = manifest.get("format")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"manifest {url} is unreadable (truncated or corrupt): {err}") from None
    check_format_version(found, CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION, f"checkpoint manifest {url}")
    try:
        objects, groups = manifest["objects"], manifest["groups"]
        for key, spec in objects.items():
            if (key.startswith("/") or ".." in key.split("/") or not isinstance(spec.get("size"), int)
                    or not _is_sha256(spec.get("sha256"))):
                raise CheckpointError(f"manifest {url} lists a bad object {key!r}")
        for kind in ("tensors", "arrays"):
            for keys in groups.get(kind, {}).values():
                if any(k not in objects for k in keys):
                    raise CheckpointError(f"manifest {url} groups name an object it does not list")
        return manifest
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"manifest {url} is unreadable (truncated or corrupt): {err}") from None


def _is_sha256(value) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _read_object(store: Store, name: str, key: str, spec: dict, kind: str | None):
    """The object once it matches the manifest: {name: tensor/array} for a kind, else its bytes."""
    url = store.key_url(f"{name}/{key}")

    def verify(info: ObjectInfo) -> None:
        if info.size != spec["size"] or info.sha256 != spec["sha256"]:
            raise CheckpointError(f"object {url} is corrupt: {info.size} bytes with sha256 {info.sha256[:12]}..., "
                                  f"manifest says {spec['size']} bytes with sha256 {str(spec['sha256'])[:12]}...")
    try:
        return objects_io.read_object(store, f"{name}/{key}", kind, spec["size"], verify)
    except ObjectMissing:
        raise CheckpointError(f"object {url} listed in the manifest is missing") from None
    except ObjectFormatError as err:
        raise CheckpointError(f"object {url} does not decode: {err}") from None


def load_checkpoint(store: Store, iteration: int, *, workers: int | None = None) -> CheckpointState:
    """Load and verify one checkpoint; CheckpointError if it is incomplete or any object does not match.
    On file:// tensors map the verified files copy-on-write (no copy; writing to one never changes the
    checkpoint)."""
    name = checkpoint_name(iteration)
    manifest = _read_manifest(store, name)
    if manifest.get("iteration") != iteration:
        raise CheckpointError(f"manifest {store.key_url(name + '/' + MANIFEST)} is for iteration "
                              f"{manifest.get('iteration')}, not {iteration}")
    objects, groups = manifest["objects"], manifest["groups"]
    kinds = {k: kind for kind in (TENSORS, ARRAYS) for keys in groups.get(kind, {}).values() for k in keys}
    total = sum(spec["size"] for spec in objects.values())
    got = _run_all({key: (_read_object, store, name, key, spec, kinds.get(key))
                         for key, spec in objects.items()}, workers or _auto_workers(store, total))
    try:
        state = CheckpointState(iteration=iteration, meta=json.loads(bytes(got[manifest["meta"]])),
                                url=store.key_url(name))
    except (ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {store.key_url(name)} meta does not decode: {err}") from None
    for kind, out in (("tensors", state.tensors), ("arrays", state.arrays)):
        for group, keys in groups.get(kind, {}).items():
            out[group] = {n: v for k in keys for n, v in got[k].items()}
    return state


def load_latest_checkpoint(store: Store, *, workers: int | None = None) -> CheckpointState | None:
    """The newest checkpoint that verifies, or None when there is no complete one. Corrupt or incomplete ones are
    reported and skipped; storage that cannot be reached, a manifest of another format version (FormatVersionError),
    or complete checkpoints none of which verifies (CheckpointError), raises: none may silently roll the run back,
    let alone to its start."""
    unusable = []
    for info in reversed(list_checkpoints(store)):
        if not info.complete:
            log.info("checkpoint %s has no manifest (an interrupted write); skipping", store.key_url(info.name))
            continue
        try:
            state = load_checkpoint(store, info.iteration, workers=workers)
        except CheckpointError as err:
            log.warning("checkpoint %s is unusable, falling back to the previous one: %s",
                        store.key_url(info.name), err)
            unusable.append(f"{info.name}: {err}")
            continue
        log.info("loaded checkpoint %s", store.key_url(info.name))
        return state
    if unusable:
        raise CheckpointError(f"no checkpoint under {store.key_url('')} verifies ({'; '.join(unusable)}); restore a "
                              "good copy there, or move them aside and start the run anew")
    return None
