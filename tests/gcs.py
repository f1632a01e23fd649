"""A Cloud Storage stand-in for the tests: gcp-storage-emulator on 127.0.0.1, in memory.

`gcsfs` (etils.epath's gs:// backend) finds it through STORAGE_EMULATOR_HOST and array_record's
own GCS reader (google-cloud-cpp) through CLOUD_STORAGE_EMULATOR_ENDPOINT, so a gs:// path in a
test goes through the same code as on Cloud Storage, over loopback.
"""

from __future__ import annotations

import contextlib
import os
import re

from tests.helpers import free_port

BUCKET = "maxlm-test"


def _serve_suffix_ranges() -> None:
    """The emulator answers a suffix range (`Range: bytes=-N`, how array_record's reader reads a
    file's footer) with the whole object; Cloud Storage answers with the last N bytes. Its
    download handler is given the equivalent `bytes=SIZE-N-` instead."""
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
        return original(request, response, storage, *args, **kwargs)

    download.serves_suffix_ranges = True
    objects.download = download
    for _, methods in server.HANDLERS:
        for method, handler in methods.items():
            if handler is original:
                methods[method] = download


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
           "CLOUD_STORAGE_EMULATOR_ENDPOINT": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
