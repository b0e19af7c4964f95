"""Webhook URLs often carry the receiver's token in their path or query. They are served in full
only to users who may change traffic (the sre role, superusers); everyone else reads
``scheme://host:port/[redacted]``. The audit log stores them redacted, logs and the look's
results name them redacted, and a redacted URL sent back in a document stands for the stored
one, so a document read by any role applies back unchanged."""

from __future__ import annotations

import json
import logging

import pytest
from django.test import Client

from experiments import services
from experiments.models import AuditEntry, Experiment
from rollouts import controller as c
from rollouts import service

pytestmark = [pytest.mark.django_db, pytest.mark.engine]

KEY = "rollout-demo"
URL = f"/api/experiments/{KEY}/"
TOKEN = "T0KEN-s3cret"
HOOK = f"https://hooks.example.com/services/{TOKEN}?key=Q-{TOKEN}"
SHOWN = "https://hooks.example.com/[redacted]"
# Nothing listens on port 9 (discard): a webhook that fails, with its token in the path.
DEAD = f"http://127.0.0.1:9/hooks/{TOKEN}"
DEAD_SHOWN = "http://127.0.0.1:9/[redacted]"


def with_hooks(doc, *urls: str) -> dict:
    doc["rollout"]["notify"] = list(urls)
    return doc


def applied(doc, users, *, start: bool = False) -> Experiment:
    experiment = services.apply_document(doc, actor=users["product"]).experiment
    return services.transition(experiment, "start", users["product"]) if start else experiment


# ---- the API ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "full"), [("product", False), ("analyst", False), ("sre", True), ("admin", True)]
)
def test_the_api_serves_webhook_urls_in_full_only_to_those_who_may_change_traffic(
    client_for, users, rollout_document, role, full
):
    applied(with_hooks(rollout_document, HOOK), users)
    client = client_for(role)
    one = client.get(URL).json()["document"]["rollout"]["notify"]
    listed = client.get("/api/experiments/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert one == ([HOOK] if full else [SHOWN])
    assert rows[0]["document"]["rollout"]["notify"] == one
    if not full:
        assert TOKEN not in json.dumps(client.get(URL).json()) and TOKEN not in json.dumps(listed)


def test_a_document_read_redacted_applies_back_unchanged(client_for, users, rollout_document):
    """GET, edit the name, PUT it back: the redacted URL stands for the stored one."""
    applied(with_hooks(rollout_document, HOOK, DEAD), users, start=True)
    product = client_for("product")
    doc = product.get(URL).json()["document"]
    assert doc["rollout"]["notify"] == [SHOWN, DEAD_SHOWN]
    doc["name"] = "renamed"
    r = product.put(URL, doc, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["changes"] == ["name: 'AWQ + FA2 rollout' -> 'renamed'"]
    assert Experiment.objects.get(key=KEY).rollout["notify"] == [HOOK, DEAD]


def test_a_redacted_url_that_stands_for_no_stored_one_is_refused_where_it_is(
    client_for, users, rollout_document
):
    applied(with_hooks(rollout_document, HOOK), users)
    doc = client_for("product").get(URL).json()["document"]
    doc["rollout"]["notify"] = [SHOWN, "https://other.example.com/[redacted]"]
    r = client_for("product").put(URL, doc, format="json")
    assert r.status_code == 400
    assert list(r.json()) == ["rollout.notify[1]"]
    assert "redacted webhook URL" in r.json()["rollout.notify[1]"][0]
    assert Experiment.objects.get(key=KEY).rollout["notify"] == [HOOK]


def test_the_changes_a_write_reports_never_show_a_webhook_url(client_for, users, rollout_document):
    applied(with_hooks(rollout_document, HOOK), users)
    new = f"https://hooks.example.com/services/{TOKEN}-2"
    r = client_for("product").patch(
        URL, {"rollout": {**rollout_document["rollout"], "notify": [new]}}, format="json"
    )
    assert r.status_code == 200, r.content
    assert TOKEN not in json.dumps(r.json())
    assert "a webhook URL changed" in r.json()["changes"][0]


# ---- the audit log ----------------------------------------------------------------------------


def test_the_audit_log_stores_webhook_urls_redacted(client_for, users, rollout_document):
    experiment = applied(with_hooks(rollout_document, HOOK), users)
    doc = services.export_document(experiment)
    doc["rollout"]["notify"] = [HOOK, DEAD]
    services.apply_document(doc, actor=users["product"])
    services.delete_experiment(Experiment.objects.get(key=KEY), actor=users["product"])
    entries = AuditEntry.objects.filter(experiment_key=KEY)
    assert [e.action for e in entries.order_by("id")] == ["create", "update", "delete"]
    for entry in entries:
        assert TOKEN not in json.dumps([entry.before, entry.after, entry.reason]), entry.action
    update = entries.get(action="update")
    assert update.after["rollout"]["notify"] == [SHOWN, DEAD_SHOWN]
    for role in ("analyst", "sre", "admin"):
        assert TOKEN not in json.dumps(client_for(role).get(f"/api/experiments/{KEY}/audit/").json())


def test_entries_written_before_are_served_redacted(client_for, users, rollout_document):
    """An entry that holds a URL in full (written before entries were stored redacted) is
    redacted when the API or the admin shows it."""
    experiment = applied(rollout_document, users)
    AuditEntry.objects.create(
        experiment=experiment,
        experiment_key=KEY,
        actor_name="pat",
        action="update",
        before={"rollout": {"notify": [HOOK]}},
        after={"rollout": {"notify": [HOOK, DEAD]}},
    )
    AuditEntry.objects.create(
        experiment=experiment,
        experiment_key=KEY,
        actor_name="rollout-controller",
        action="rollout_notify_failed",
        before={"action": "start"},
        after={"webhooks": [{"url": DEAD, "error": f"ConnectError: POST /hooks/{TOKEN} refused"}]},
    )
    body = client_for("analyst").get("/api/audit/").json()
    assert TOKEN not in json.dumps(body) and SHOWN in json.dumps(body) and DEAD_SHOWN in json.dumps(body)
    admin = Client()
    admin.force_login(users["admin"])
    for entry in AuditEntry.objects.filter(experiment_key=KEY):
        page = admin.get(f"/admin/experiments/auditentry/{entry.pk}/change/")
        assert page.status_code == 200 and TOKEN not in page.content.decode()


# ---- the controller's webhooks: results, audit, logs ------------------------------------------


def test_a_failing_webhook_is_logged_audited_and_reported_without_its_url(users, rollout_document, caplog):
    applied(with_hooks(rollout_document, DEAD), users, start=True)
    with caplog.at_level(logging.WARNING, logger="rollouts.service"):
        r = service.look(KEY, interval_s=0)
    assert r.decision.action == c.START
    assert r.notified[0]["url"] == DEAD_SHOWN and "ConnectError" in r.notified[0]["error"]
    assert TOKEN not in json.dumps(r.as_dict())
    warned = [rec.getMessage() for rec in caplog.records if "webhook" in rec.getMessage()]
    assert warned and DEAD_SHOWN in warned[0]
    assert TOKEN not in caplog.text
    failed = AuditEntry.objects.get(experiment_key=KEY, action="rollout_notify_failed")
    assert failed.after["webhooks"][0]["url"] == DEAD_SHOWN
    assert TOKEN not in json.dumps([failed.before, failed.after, failed.reason])


def test_the_webhook_itself_still_gets_the_full_url(users, rollout_document):
    """Redaction is what people read: the POST goes to the URL as written."""
    from tests.rollouts.test_webhook_rebinding import Listener

    receiver = Listener()
    try:
        url = f"http://127.0.0.1:{receiver.port}/hook/{TOKEN}?key=Q"
        applied(with_hooks(rollout_document, url), users, start=True)
        r = service.look(KEY, interval_s=0)
    finally:
        receiver.close()
    assert r.notified[0].get("status") == 200 and [b["action"] for b in receiver.bodies] == ["start"]
    assert receiver.paths == [f"/hook/{TOKEN}?key=Q"]
