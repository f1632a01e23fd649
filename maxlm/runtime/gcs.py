"""Cloud Storage operations that etils.epath does not offer, through gcsfs's JSON API calls.

- Generation preconditions (`ifGenerationMatch`): a write or delete that happens only if the
  object is still the version read (generation 0: no object yet). Cloud Storage checks it
  atomically, so of two writers holding the same generation exactly one succeeds: the
  compare-and-swap a lease needs (maxlm/checkpoint/workdir_lock.py).
- `append`: compose, Cloud Storage's own append. The new bytes are uploaded as a small segment,
  composed onto the end of the object server-side, and the segment deleted: what a flush costs
  is its own bytes, not the whole file's.

Every call goes to the service (no cached listing is consulted), and the objects written are
dropped from gcsfs's listing cache so epath, which shares the filesystem, reads them anew.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import uuid

from maxlm.runtime.errors import UserError

SEGMENT_PREFIX = ".maxlm-append-"  # a name no reader matches (TensorBoard looks for "tfevents")


class GenerationChanged(Exception):
    """A precondition failed (HTTP 412): the object is not at the generation given."""


REACH_TIMEOUT_SEC = 5.0  # one TCP connect; gcsfs itself retries a dead endpoint for most of a minute


def endpoint() -> tuple[str, int]:
    """The host and port gcsfs sends its requests to: STORAGE_EMULATOR_HOST's, or Cloud Storage's."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator and emulator != "default":
        parsed = urllib.parse.urlsplit(emulator if "://" in emulator else f"http://{emulator}")
        return parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    return "storage.googleapis.com", 443


def check_reachable(url: str) -> None:
    """UserError (one line) when Cloud Storage's endpoint cannot be reached from here (no network,
    no DNS, a firewall), found in seconds, before gcsfs's minute of retries and tracebacks."""
    host, port = endpoint()
    try:
        socket.create_connection((host, port), timeout=REACH_TIMEOUT_SEC).close()
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise UserError(f"{url}: Cloud Storage ({host}:{port}) cannot be reached from this machine ({reason}): "
                        "no network, or a firewall or proxy in the way") from None


def filesystem():
    """epath's own gcsfs filesystem (same arguments, so fsspec's cache gives the same instance)."""
    import fsspec

    return fsspec.filesystem("gs", finalize_on_close=True)


def bucket_and_key(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("gs://").partition("/")
    return bucket, key


def read(url: str) -> tuple[bytes, int] | None:
    """The object's contents and the generation they belong to (one request), or None if absent."""
    fs = filesystem()
    try:
        headers, body = fs.call("GET", "b/{}/o/{}", *bucket_and_key(url), alt="media")
    except FileNotFoundError:
        return None
    return body, int(headers["x-goog-generation"])


def write(url: str, data: bytes, if_generation: int | None = None) -> int:
    """Writes the object whole; with `if_generation`, only if it is still at that generation
    (0: only if absent), else GenerationChanged. Returns the new generation."""
    fs = filesystem()
    bucket, key = bucket_and_key(url)
    upload = fs.base.replace("/storage/v1/", "/upload/storage/v1/") + "b/{}/o"
    try:
        written = fs.call("POST", upload, bucket, uploadType="media", name=key, data=data,
                          ifGenerationMatch=if_generation, headers={"Content-Type": "text/plain"},
                          json_out=True)
    except FileExistsError as e:  # gcsfs's name for 412 Precondition Failed
        raise GenerationChanged(url) from e
    finally:
        fs.invalidate_cache(url)
    return int(written["generation"])


def delete(url: str, if_generation: int | None = None) -> None:
    """Deletes the object; with `if_generation`, only if it is still at that generation, else
    GenerationChanged (FileNotFoundError if absent)."""
    fs = filesystem()
    try:
        fs.call("DELETE", "b/{}/o/{}", *bucket_and_key(url), ifGenerationMatch=if_generation)
    except FileExistsError as e:
        raise GenerationChanged(url) from e
    finally:
        fs.invalidate_cache(url)


def append(url: str, data: bytes) -> None:
    """Appends `data` to the existing object `url`: uploaded beside it as a segment, composed onto
    its end, the segment deleted. NotImplementedError where the bucket has no compose (gcsfs says
    so of zonal buckets)."""
    fs = filesystem()
    segment = f"{url.rpartition('/')[0]}/{SEGMENT_PREFIX}{uuid.uuid4().hex}"
    write(segment, data)
    try:
        fs.merge(url, [url, segment])
    finally:
        fs.invalidate_cache(url)
        fs.rm_file(segment)
