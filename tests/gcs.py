"""A Cloud Storage stand-in for the tests: gcp-storage-emulator on 127.0.0.1, in memory.

`gcsfs` (etils.epath's gs:// backend) finds it through STORAGE_EMULATOR_HOST, array_record's
own GCS reader (google-cloud-cpp) through CLOUD_STORAGE_EMULATOR_ENDPOINT, and tensorstore's GCS
driver (orbax's array data) through TENSORSTORE_GCS_HTTP_URL with the fixed token of
GOOGLE_AUTH_TOKEN_FOR_TESTING, so a gs:// path in a test goes through the same code as on Cloud
Storage, over loopback. NO_GCE_CHECK keeps google-auth (which gcsfs asks for credentials to look up
a bucket's layout, then falls back) from probing the GCE metadata server at 169.254.169.254.
Where the emulator differs from Cloud Storage in what maxlm relies on, it is patched: suffix
ranges, generation headers, generation preconditions (the workdir lease). `uploads` counts
the bytes each upload sends. `fake_gcs(refuse=401 or 403)` answers every request as Cloud Storage
refusing the caller, for the checks of a workdir that cannot be used.
"""

from __future__ import annotations

import contextlib
import os
import re

from tests.helpers import free_port

BUCKET = "maxlm-test"


def _serve_suffix_ranges() -> None:
    """Two fixes to the emulator's download handler, where it differs from Cloud Storage:
    - it answers a suffix range (`Range: bytes=-N`, how array_record's reader reads a file's
      footer) with the whole object; Cloud Storage answers with the last N bytes. The handler is
      given the equivalent `bytes=SIZE-N-` instead;
    - it sends no `x-goog-generation` header, which tensorstore reads on every download ("Malformed
      StorageGeneration" without it: orbax's OCDBT manifest could not be read back).
    And a client that hangs up before the answer (gcsfs asks for an object and for it as a prefix
    at once and drops the slower) is not printed as a BrokenPipeError traceback."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.download, "serves_suffix_ranges", False):
        return
    original = objects.download

    def download(request, response, storage, *args, **kwargs):
        wanted = re.fullmatch(r"\s*bytes=-(\d+)\s*", request.get_header("range", "") or "")
        if wanted:
            with contextlib.suppress(Exception):  # a missing object: the handler says so
                size = len(storage.get_file(request.params["bucket_name"], request.params["object_id"]))
                headers = request._request_handler.headers
                headers.replace_header("range", f"bytes={max(0, size - int(wanted[1]))}-")
        with contextlib.suppress(Exception):  # a missing object: the handler says so
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = obj["generation"]
            response["x-goog-metageneration"] = obj["metageneration"]
        return original(request, response, storage, *args, **kwargs)

    download.serves_suffix_ranges = True
    _replace_handler(original, download)
    handle = server.Router.handle

    def handle_unless_gone(self, method):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if refusing:
                return _refuse(self._request_handler, method, refusing[0])
            return handle(self, method)

    server.Router.handle = handle_unless_gone


REFUSALS = {  # Cloud Storage's words for a caller it refuses: no credentials, or an account without access
    401: "Anonymous caller does not have storage.objects.list access to the Google Cloud Storage bucket. "
         "Permission 'storage.objects.list' denied on resource (or it may not exist).",
    403: "runner@example-project.iam.gserviceaccount.com does not have storage.objects.list access to the "
         "Google Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may not exist).",
}
refusing: list[int] = []  # the status fake_gcs(refuse=...) answers every request with


def _refuse(request_handler, method, status) -> None:
    """Answers as Cloud Storage refusing the caller, in its JSON error shape; a token refresh
    (a POST to /token, where a test's credentials file sends it) as Google's token endpoint
    refusing an expired or revoked grant."""
    from http import HTTPStatus

    from gcp_storage_emulator.server import Request, Response

    request, response = Request(request_handler, method), Response(request_handler)
    _ = request.data  # read, so the connection stays usable
    if request.path == "/token":
        status, body = 400, {"error": "invalid_grant", "error_description": "Token has been expired or revoked."}
    else:
        reason = "required" if status == 401 else "forbidden"
        body = {"error": {"code": status, "message": REFUSALS[status],
                          "errors": [{"message": REFUSALS[status], "domain": "global", "reason": reason}]}}
    response.status = HTTPStatus(status)
    response.json(body)
    response.close()


def _replace_handler(original, replacement) -> None:
    """Routes the emulator's requests for handler `original` to `replacement`."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    setattr(objects, original.__name__, replacement)  # the emulator also calls some by module name
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = replacement


def _object_name(request) -> str | None:
    """The object a request is about: in its path, its query (a simple upload) or its metadata."""
    if "object_id" in request.params:
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data if isinstance(request.data, dict) else {}
    return data.get("meta", data).get("name")


def _honour_generation_preconditions() -> None:
    """The emulator ignores `ifGenerationMatch`, which Cloud Storage checks on uploads, deletes
    and composes: the object's generation (0: no object) must be the one given, else 412
    Precondition Failed and nothing changes. The emulator serves one request at a time, so the
    check and the write are atomic, as on Cloud Storage."""
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.compose, "honours_preconditions", False):
        return

    def conditional(original):
        def handler(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifGenerationMatch")
            if wanted is not None:
                try:
                    generation = storage.get_file_obj(request.params["bucket_name"], _object_name(request))["generation"]
                except NotFound:
                    generation = "0"
                if str(generation) != wanted[0]:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                    return None
            return original(request, response, storage, *args, **kwargs)

        handler.__name__ = original.__name__
        handler.honours_preconditions = True
        return handler

    for original in (objects.insert, objects.delete, objects.compose):
        _replace_handler(original, conditional(original))


uploads: list[tuple[str, int]] = []  # (object name, bytes) of every upload request fake_gcs served


def _record_uploads() -> None:
    """Records in `uploads` the bytes each upload request sends (a simple upload's object, a
    resumable upload's chunk), for tests that count what a writer sends."""
    from gcp_storage_emulator.handlers import objects

    if getattr(objects.upload_partial, "records_uploads", False):
        return
    insert, upload_partial = objects.insert, objects.upload_partial

    def recorded_insert(request, response, storage, *args, **kwargs):
        if request.query.get("uploadType", [""])[0] in ("media", "multipart"):
            content = request.data["content"] if isinstance(request.data, dict) else request.data
            uploads.append((_object_name(request), len(content or b"")))
        return insert(request, response, storage, *args, **kwargs)

    def recorded_upload_partial(request, response, storage, *args, **kwargs):
        with contextlib.suppress(Exception):  # an unknown upload: the handler says so
            name = storage.get_resumable_file_obj(request.query["upload_id"][0])["name"]
            uploads.append((name, len(request.data or b"")))
        return upload_partial(request, response, storage, *args, **kwargs)

    recorded_insert.__name__, recorded_upload_partial.__name__ = "insert", "upload_partial"
    recorded_upload_partial.records_uploads = True
    _replace_handler(insert, recorded_insert)
    _replace_handler(upload_partial, recorded_upload_partial)


@contextlib.contextmanager
def fake_gcs(refuse: int | None = None):
    """Serves an empty bucket `BUCKET`; yields the environment that points clients at it (also
    set in this process while it runs). `refuse` (401, 403): every request is refused so."""
    from gcp_storage_emulator.server import create_server

    _serve_suffix_ranges()
    _honour_generation_preconditions()
    _record_uploads()
    uploads.clear()
    refusing[:] = [refuse] if refuse else []
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": f"http://127.0.0.1:{port}",
           "TENSORSTORE_GCS_HTTP_URL": f"http://127.0.0.1:{port}",
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "NO_GCE_CHECK": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from google.auth.compute_engine import _metadata  # reads NO_GCE_CHECK when first imported

    no_gce_check = _metadata._NO_GCE_CHECK
    _metadata._NO_GCE_CHECK = True
    try:
        yield env
    finally:
        _metadata._NO_GCE_CHECK = no_gce_check
        refusing.clear()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
