"""Traces over the API and the admin: sre uploads and deletes, every role reads."""

import io

import pytest
from django.test import Client

from tests.traces.conftest import TINY
from traces.models import Trace
from traces.uploads import UploadCap

ROLES = ["product", "sre", "analyst", "nobody", "admin", None]


def upload(client, text: str = TINY, filename: str = "tiny.csv", **fields):
    f = io.BytesIO(text.encode())
    f.name = filename
    return client.post("/api/traces/", {"file": f, **fields}, format="multipart")


@pytest.mark.django_db
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.engine
def test_role_matrix(role, client_for):
    client = client_for(role)
    created = upload(client)
    can_upload = role in ("sre", "admin")
    assert created.status_code == (401 if role is None else 201 if can_upload else 403)
    trace = Trace.objects.first()
    if trace is None:
        trace = Trace.objects.create(name="t", sha256="0" * 64, size=1, format="azure", rows=1, span_s=0)
    can_read = role in ("sre", "admin", "product", "analyst")
    read = 401 if role is None else 200 if can_read else 403
    assert client.get("/api/traces/").status_code == read
    assert client.get(f"/api/traces/{trace.name}/").status_code == read
    assert client.delete(f"/api/traces/{trace.sha256}/").status_code == (
        401 if role is None else 204 if can_upload else 403
    )


@pytest.mark.django_db
@pytest.mark.engine
def test_an_upload_is_listed_with_its_figures_and_deduped_by_hash(client_for, trace_dir):
    sre = client_for("sre")
    first = upload(sre)
    data = first.json()
    assert first.status_code == 201 and first["Location"] == data["url"]
    assert data["url"].endswith(f"/api/traces/{data['sha256']}/")
    assert (data["name"], data["format"], data["rows"], data["span_s"], data["rate"]) == (
        "tiny.csv",
        "azure",
        3,
        4.0,
        0.75,
    )
    assert data["uploaded_by"] == "sam" and data["size"] == len(TINY)
    again = upload(sre, filename="copy.csv")
    assert again.status_code == 200 and again.json()["sha256"] == data["sha256"]
    listed = client_for("analyst").get("/api/traces/").json()["results"]
    assert [(t["name"], t["rows"]) for t in listed] == [("tiny.csv", 3)]
    assert client_for("product").get(f"/api/traces/{data['sha256']}/").json()["rate"] == 0.75
    assert sorted(p.name for p in trace_dir.iterdir()) == [data["sha256"]]


@pytest.mark.django_db
def test_an_oversized_upload_is_413_and_stores_nothing(client_for, settings, trace_dir):
    settings.TRACE_MAX_BYTES = 2048
    response = upload(client_for("sre"), text=TINY + "2023-11-16 18:17:06.5,12,5\n" * 5000)
    assert response.status_code == 413
    assert "over the cap of 2048 bytes (TRACE_MAX_BYTES)" in response.json()["file"][0]
    assert not Trace.objects.exists() and not (trace_dir.exists() and list(trace_dir.iterdir()))


def test_the_upload_cap_stops_a_streamed_body_past_the_cap():
    """No Content-Length to go by (a chunked body): the handler stops at the cap."""
    from django.core.files.uploadhandler import StopUpload

    cap = UploadCap(cap=100)
    assert cap.handle_raw_input(None, {}, 150, b"b") is None  # within the slack for other fields
    assert cap.receive_data_chunk(b"x" * 60, 0) == b"x" * 60
    with pytest.raises(StopUpload):
        cap.receive_data_chunk(b"x" * 60, 60)
    assert cap.too_large
    assert UploadCap(cap=100).handle_raw_input(None, {}, 10**9, b"b") is not None  # refused unread


@pytest.mark.django_db
def test_a_malformed_upload_is_a_400_naming_line_and_field(client_for):
    response = upload(client_for("sre"), text=TINY + "2023-11-16 18:17:07.5,12,\x1bx\n")
    assert response.status_code == 400
    assert (
        "line 5: GeneratedTokens must be a whole number in [1, 1000000], got '\\x1bx'"
        in response.json()["file"][0]
    )
    bad_name = upload(client_for("sre"), name="../../etc/cron.d/x")
    assert bad_name.status_code == 400 and "letters, digits" in bad_name.json()["name"][0]
    assert not Trace.objects.exists()


@pytest.mark.django_db
@pytest.mark.engine
def test_delete_removes_the_file(client_for, trace_dir, django_capture_on_commit_callbacks):
    sha = upload(client_for("sre")).json()["sha256"]
    with django_capture_on_commit_callbacks(execute=True):
        assert client_for("sre").delete(f"/api/traces/{sha}/").status_code == 204
    assert not (trace_dir / sha).exists()
    assert client_for("sre").get(f"/api/traces/{sha}/").status_code == 404


@pytest.mark.django_db
@pytest.mark.engine
def test_sre_uploads_in_the_admin_and_others_cannot(users, settings, trace_dir):
    sre = Client(enforce_csrf_checks=True)
    sre.force_login(users["sre"])
    page = sre.get("/admin/traces/trace/")
    assert "Upload a trace" in page.content.decode()
    form = sre.get("/admin/traces/trace/upload/")
    token = form.cookies["csrftoken"].value
    f = io.BytesIO(TINY.encode())
    f.name = "tiny.csv"
    done = sre.post(
        "/admin/traces/trace/upload/", {"file": f, "name": "", "format": "", "csrfmiddlewaretoken": token}
    )
    trace = Trace.objects.get()
    assert done.status_code == 302 and (trace.name, trace.rows, trace.uploaded_by) == (
        "tiny.csv",
        3,
        users["sre"],
    )
    no_token = sre.post("/admin/traces/trace/upload/", {"file": io.BytesIO(b"x"), "name": "x"})
    assert no_token.status_code == 403  # CSRF still checked, after the upload cap is in place
    settings.TRACE_MAX_BYTES = 1024
    big = io.BytesIO(b"x" * 200_000)
    big.name = "big.csv"
    over = sre.post("/admin/traces/trace/upload/", {"file": big, "csrfmiddlewaretoken": token})
    assert over.status_code == 413 and "over the cap of 1024 bytes" in over.content.decode()
    assert Trace.objects.count() == 1
    analyst = Client()
    analyst.force_login(users["analyst"])
    assert analyst.get("/admin/traces/trace/").status_code == 200
    assert "Upload a trace" not in analyst.get("/admin/traces/trace/").content.decode()
    assert analyst.get("/admin/traces/trace/upload/").status_code == 403
