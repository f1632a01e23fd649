"""A Cloud Storage stand-in for the tests: gcp-storage-emulator on 127.0.0.1, in memory.

`gcsfs` (etils.epath's gs:// backend) finds it through STORAGE_EMULATOR_HOST, array_record's
own GCS reader (google-cloud-cpp) through CLOUD_STORAGE_EMULATOR_ENDPOINT, and tensorstore's GCS
driver (orbax's array data) through TENSORSTORE_GCS_HTTP_URL with the fixed token of
GOOGLE_AUTH_TOKEN_FOR_TESTING, so a gs:// path in a test goes through the same code as on Cloud
Storage, over loopback. NO_GCE_CHECK keeps google-auth (which gcsfs asks for credentials to look up
a bucket's layout, then falls back) from probing the GCE metadata server at 169.254.169.254.
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
    objects.download = download
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = download
    handle = server.Router.handle

    def handle_unless_gone(self, method):
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            return handle(self, method)

    server.Router.handle = handle_unless_gone


@contextlib.contextmanager
def fake_gcs():
    """Serves an empty bucket `BUCKET`; yields the environment that points clients at it (also
    set in this process while it runs)."""
    from gcp_storage_emulator.server import create_server

    _serve_suffix_ranges()
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
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
