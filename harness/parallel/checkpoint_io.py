"""Saving and loading a sharded state with ``torch.distributed.checkpoint``, so that a bad checkpoint
is refused with a message that names the file and the key, and the target state is left untouched.

DCP itself writes ``.metadata`` (what every key's chunks are and where their bytes lie) and one
``__<rank>_<n>.distcp`` file per rank; it records no checksums, so a flipped byte in a data file
loads silently as a wrong value, and a save that dies half way leaves a directory that looks like a
checkpoint. Around it:

* save writes into ``<path>.partial-<token>``; after DCP's save returned on every rank (the
  coordinator has written ``.metadata``), the coordinator records a SHA-256 of ``.metadata`` and of
  every key's byte range in ``manifest.json`` and only then renames the directory to ``<path>``
  (atomic). A rank killed during the save leaves a ``.partial-`` directory without a manifest and
  no ``<path>``: nothing that loads.
* load checks everything before any tensor is touched, on every rank alike (each rank reads the same
  files, so all raise the same error and none is left waiting in a collective): the directory, the
  manifest, ``.metadata``'s checksum, each key's file, length and checksum, and that the checkpoint
  holds exactly the target's keys with the target's global shapes and dtypes. It then loads into a
  copy of the target state and hands that copy back; the caller applies it only after success.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # DCP's own key flattening
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

MANIFEST = "manifest.json"
METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into the target: the message names the file and the key."""


def save(state: dict, path: str, group, *, sync_files: bool = True) -> None:
    """Save ``state`` (a DCP state dict) to directory ``path`` with every rank of ``group``.

    ``group``: the process group of exactly the ranks that hold ``state`` (DCP's collectives run on
    it, so ranks outside the layout need not take part).
    """
    if os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} already exists; save to a new directory")
    token = [uuid.uuid4().hex]  # one partial directory per save, agreed by the coordinator
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    partial = f"{path}.partial-{token[0]}"
    writer = FileSystemWriter(partial, sync_files=sync_files)
    metadata = dcp.save(state, storage_writer=writer, process_group=group)
    if dist.get_rank(group) == 0:
        _write_manifest(partial, metadata)
        os.rename(partial, path)  # the checkpoint exists only once it is complete
    dist.barrier(group=group)  # no rank returns (and loads) before the rename


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _item_name(key: str, offset) -> str:
    """A storage item as users know it: the flattened key, and the chunk's offset when sharded."""
    return f"{key!r}" + (f" (chunk at offset {list(offset)})" if offset is not None else "")


def _write_manifest(directory: str, metadata: Metadata) -> None:
    with open(os.path.join(directory, METADATA), "rb") as f:
        items = [{"metadata": _sha(f.read())}]
    files: dict[str, bytes] = {}
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        if info.relative_path not in files:
            with open(os.path.join(directory, info.relative_path), "rb") as f:
                files[info.relative_path] = f.read()
        data = files[info.relative_path][info.offset:info.offset + info.length]
        items.append({"key": index.fqn, "offset": None if index.offset is None else list(index.offset),
                      "file": info.relative_path, "start": info.offset, "length": info.length, "sha256": _sha(data)})
    tmp = os.path.join(directory, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(items, f, indent=0)
    os.rename(tmp, os.path.join(directory, MANIFEST))


def verify(path: str) -> Metadata:
    """Check that ``path`` holds a complete, intact checkpoint; return its DCP metadata."""
    if not os.path.isdir(path):
        parent, name = os.path.split(path)
        partial = sorted(p for p in os.listdir(parent or ".") if p.startswith(f"{name}.partial-")) \
            if os.path.isdir(parent or ".") else []
        hint = f" (found {partial}: a save that did not complete)" if partial else ""
        raise CheckpointError(f"no checkpoint at {path}: the directory does not exist{hint}")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"{manifest_path} is missing: {path} is not a complete checkpoint "
                              "(a save that was interrupted leaves no manifest)")
    try:
        with open(manifest_path) as f:
            head, *items = json.load(f)
        expected_metadata = head["metadata"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path} is corrupted ({type(error).__name__}: {error})") from None
    metadata_path = os.path.join(path, METADATA)
    try:
        with open(metadata_path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise CheckpointError(f"{metadata_path} cannot be read ({error})") from None
    if _sha(raw) != expected_metadata:
        raise CheckpointError(f"{metadata_path} is corrupted: its checksum differs from the one recorded at save "
                              f"in {manifest_path}")
    metadata = pickle.loads(raw)
    sizes: dict[str, int] = {}
    for item in items:
        file = os.path.join(path, item["file"])
        what = f"key {_item_name(item['key'], item['offset'])}"
        if item["file"] not in sizes:
            if not os.path.exists(file):
                raise CheckpointError(f"{file} is missing; it holds {what}")
            sizes[item["file"]] = os.path.getsize(file)
        end = item["start"] + item["length"]
        if sizes[item["file"]] < end:
            raise CheckpointError(f"{file} is truncated: {sizes[item['file']]} bytes, but {what} "
                                  f"lies at bytes {item['start']}..{end}")
        with open(file, "rb") as f:
            f.seek(item["start"])
            if _sha(f.read(item["length"])) != item["sha256"]:
                raise CheckpointError(f"{file} is corrupted: the bytes of {what} at {item['start']}..{end} "
                                      "differ from the checksum recorded at save")
    return metadata


def _global_shape(value) -> tuple[int, ...]:
    return tuple(value.shape)  # a DTensor reports its global shape


def check_keys(state: dict, metadata: Metadata, path: str) -> None:
    """The checkpoint must hold exactly the target's keys, with the target's global shapes and dtypes."""
    where = os.path.join(path, METADATA)
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    if missing:
        raise CheckpointError(f"{where} has no key {missing[0]!r} that the target needs"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                              "the checkpoint was saved from a different model")
    extra = [k for k in saved if k not in flat]
    if extra:
        raise CheckpointError(f"{where} holds key {extra[0]!r} that the target does not have"
                              f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}: "
                              "the checkpoint was saved from a different model")
    for key, value in flat.items():
        meta = saved[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"{where}: key {key!r} is saved as an object, the target holds a tensor")
            if tuple(meta.size) != _global_shape(value) or meta.properties.dtype != value.dtype:
                raise CheckpointError(
                    f"{where}: key {key!r} is saved with shape {list(meta.size)} {meta.properties.dtype}, "
                    f"the target has {list(_global_shape(value))} {value.dtype}: "
                    "the checkpoint was saved from a different model")
        elif not isinstance(meta, BytesStorageMetadata):
            raise CheckpointError(f"{where}: key {key!r} is saved as a tensor, the target holds {type(value).__name__}")


def _copy(state):
    """A deep copy of a state dict whose tensors (DTensors too) own fresh storage."""
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy(v) for v in state]
    if isinstance(state, (torch.Tensor, DTensor)):
        return state.detach().clone()
    return copy.deepcopy(state)


def load(state: dict, path: str, group) -> dict:
    """Load checkpoint ``path`` for a target shaped like ``state``; return the loaded copy.

    ``state`` itself is never written: a caller applies the returned copy (``set_state_dict``) once
    this returns, so a checkpoint refused half way leaves the target as it was.
    """
    metadata = verify(path)
    check_keys(state, metadata, path)
    loaded = _copy(state)
    try:
        dcp.load(loaded, storage_reader=FileSystemReader(path), process_group=group)
    except Exception as error:  # noqa: BLE001  verified above; anything left is DCP's own, re-worded once
        raise CheckpointError(f"loading {path} failed after it was verified: {type(error).__name__}: {error}") from error
    return loaded
