"""Cloud Storage operations that etils.epath does not offer, through gcsfs's JSON API calls.

- Generation preconditions (`ifGenerationMatch`): a write or delete that happens only if the
  object is still the version read (generation 0: no object yet). Cloud Storage checks it
  atomically, so of two writers holding the same generation exactly one succeeds: the
  compare-and-swap a lease needs (maxlm/checkpoint/workdir_lock.py).
- `append`: compose, Cloud Storage's own append. The new bytes are uploaded as a small segment,
  composed onto the end of the object server-side, and the segment deleted: what a flush costs
  is its own bytes, not the whole file's.
- The start-up checks of a gs:// workdir (`check_reachable`, `check_access`): one line and exit 2,
  in seconds, where gcsfs would retry and end in a traceback.

Every call goes to the service (no cached listing is consulted), and the objects written are
dropped from gcsfs's listing cache so epath, which shares the filesystem, reads them anew.
"""

from __future__ import annotations

import logging
import os
import socket
import urllib.parse
import uuid

from maxlm.runtime.errors import UserError

SEGMENT_PREFIX = ".maxlm-append-"  # a name no reader matches (TensorBoard looks for "tfevents")


class GenerationChanged(Exception):
    """A precondition failed (HTTP 412): the object is not at the generation given."""


REACH_TIMEOUT_SEC = 5.0  # one TCP connect; gcsfs itself retries a dead endpoint for most of a minute
ACCESS_TIMEOUT_SEC = 10.0  # one request; gcsfs gives it aiohttp's 5 minutes, then retries
LOG_IN = ("run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a "
          "service-account key file")


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


def check_access(url: str) -> None:
    """UserError (one line: `url`, the HTTP status, what to do) when Cloud Storage answers but
    refuses the workdir: no credentials found on this machine, or the ones found refused (401); an
    account without access to the bucket (403); no such bucket (404); or no answer within
    ACCESS_TIMEOUT_SEC. One request, a one-object listing under `url` with the credentials gcsfs
    found, through the filesystem epath then uses. A prefix with no objects yet is no error (a new
    run makes it); any other failure is left to the run (gcsfs retries a 5xx, for one)."""
    from fsspec.asyn import FSTimeoutError, sync
    from gcsfs.retry import HttpError

    bucket, key = bucket_and_key(url)
    fs = _filesystem_with_credentials()
    once = type(fs)._request.__wrapped__  # without gcsfs's retries, which take half a minute on a refused token
    try:
        sync(fs.loop, once, fs, "GET", "b/{}/o", bucket, prefix=key, maxResults=1, timeout=ACCESS_TIMEOUT_SEC)
        return
    except FileNotFoundError:  # of a bucket's listing: the bucket
        raise UserError(f"{url}: HTTP 404 from Cloud Storage: bucket {bucket} does not exist; create it "
                        f"(`gcloud storage buckets create gs://{bucket}`) or correct the URL") from None
    except FSTimeoutError:
        host, port = endpoint()
        raise UserError(f"{url}: Cloud Storage ({host}:{port}) did not answer within "
                        f"{ACCESS_TIMEOUT_SEC:.0f} s") from None
    except Exception as e:  # the rest: sorted below, and what is not a refusal left to the run
        refused = e
    if isinstance(refused, HttpError) and refused.code == 401:
        if fs.credentials.credentials is None:  # google-auth found none, so gcsfs went on anonymously
            given = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
            found = f"GOOGLE_APPLICATION_CREDENTIALS={given} gave none" if given else "none were found on this machine"
            raise UserError(f"{url}: HTTP 401 from Cloud Storage: no credentials ({found}); {LOG_IN}")
        raise UserError(f"{url}: HTTP 401 from Cloud Storage: the credentials found were refused (expired, "
                        f"revoked or a deleted key); {LOG_IN}")
    if type(refused) is OSError and str(refused).startswith("Forbidden"):  # gcsfs's 403
        said = " ".join(str(refused).split("\n")[1:])  # Cloud Storage's words, which name the account
        raise UserError(f"{url}: HTTP 403 from Cloud Storage: the account has no access to bucket {bucket} "
                        f"({said}); grant it the storage.objects.* permissions there (e.g. roles/storage.objectUser)")


def _filesystem_with_credentials():
    """filesystem(), its credentials looked up without gcsfs's own probe of a GCE metadata server
    (its "cloud" step, tried after google-auth's own probe in "google_default" found none, and
    retried for seconds before gcsfs goes on anonymously), and without google-auth's warnings
    about where it found none (check_access says what that means)."""
    import gcsfs.credentials  # noqa: F401 (imports google-auth's _metadata, which reads NO_GCE_CHECK once)

    auth_log, saved = logging.getLogger("google.auth"), os.environ.get("NO_GCE_CHECK")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    # gcsfs reads the variable as it connects: its probe (15 s on a machine without credentials,
    # gcsfs 2026.10.1) is skipped; google-auth read it on import, so its own probe stays
    os.environ["NO_GCE_CHECK"] = "true"
    try:
        return filesystem()
    finally:
        auth_log.setLevel(level)
        if saved is None:
            os.environ.pop("NO_GCE_CHECK")
        else:
            os.environ["NO_GCE_CHECK"] = saved


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
