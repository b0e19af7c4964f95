"""Capping an HTTP upload before Django buffers it (the API's and the admin's upload)."""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict

MULTIPART_SLACK = 64 * 1024  # the form's other fields and the boundaries around the file


class UploadCap(FileUploadHandler):
    """Put first among a request's upload handlers (``install``), before anything reads the
    body: refuses a body over TRACE_MAX_BYTES by its Content-Length without reading it, and
    stops reading a file that streams past the cap, so under the web process (WSGI) an
    oversized upload never reaches memory or a temporary file. Under ``gateway --with-web``
    (ASGI) Django spools the body before any handler runs: there gateway/with_web.py refuses
    it by its Content-Length, or at the cap for a chunked one (docs/deploy.md). The view then
    answers 413 when ``too_large``."""

    def __init__(self, request=None, *, cap: int):
        super().__init__(request)
        self.cap, self.received, self.too_large = cap, 0, False

    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        if content_length > self.cap + MULTIPART_SLACK:
            self.too_large = True
            return QueryDict(encoding=encoding), MultiValueDict()  # "handled": nothing read
        return None

    def receive_data_chunk(self, raw_data, start):
        self.received += len(raw_data)
        if self.received > self.cap:
            self.too_large = True
            raise StopUpload(connection_reset=True)
        return raw_data

    def file_complete(self, file_size):
        return None


def max_body_bytes() -> int:
    """The largest upload request body: the trace cap and the form around it (the web process
    checks it here, `manage.py gateway --with-web` before Django reads the body)."""
    return settings.TRACE_MAX_BYTES + MULTIPART_SLACK


def declared_too_large(request) -> bool:
    """The body says (Content-Length) it is over the cap: refuse it without reading it."""
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return False
    return length > max_body_bytes()


def install(request) -> UploadCap:
    """Cap this (Django) request's uploads; call before the body is read."""
    cap = UploadCap(request, cap=settings.TRACE_MAX_BYTES)
    request.upload_handlers.insert(0, cap)
    return cap
