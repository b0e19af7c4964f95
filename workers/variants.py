"""A replay's connections to its variants, built from Variant rows under the platform's egress
rules (streaming/egress.py): every connection checked against ABPLAT_VARIANT_ALLOWED_HOSTS
after name resolution, and a variant's named secret sent as its Authorization.

The secret is read from ABPLAT_VARIANT_SECRETS_DIR when a client is built (so a rotated file
takes effect at the next shard) and lives only in that client's headers: never in the
database, a log line, an error message or the run's records. It is read only where the
operator's binding lets the experiment's team send it to the endpoint's host
(streaming.egress.bound_bearer); elsewhere the client is not built (SecretError).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from django.conf import settings

from experiments.checks import variant_allowlist
from experiments.models import Variant
from streaming.client import VariantClient
from streaming.egress import Allowlist, bound_bearer
from streaming.probe import TokenCounter, token_counter


def allowlist() -> Allowlist:
    return variant_allowlist()


def ca_verify() -> bool | str:
    return settings.VARIANT_CA_BUNDLE or True  # True: the system trust store


def auth_headers(
    secret_name: str, secrets_dir: str | None = None, *, endpoint: str, team: str
) -> dict[str, str]:
    """The Authorization header for a variant's secret on its way to ``endpoint`` for an
    experiment of ``team`` ({} when it names none); SecretError (naming the secret, not its
    value) when the operator has not configured it or its binding does not allow that host or
    team."""
    if not secret_name:
        return {}
    directory = settings.VARIANT_SECRETS_DIR if secrets_dir is None else secrets_dir
    return bound_bearer(directory, secret_name, url=endpoint, team=team)


def team_of(variant: Variant) -> str:
    """The name of the team owning ``variant``'s experiment. ReplayRun.replay_variants loads it
    with the variants, so a shard's event loop reads it without a query."""
    return variant.experiment.team.name


def variant_headers(variant: Variant, secrets_dir: str | None = None) -> dict[str, str]:
    """auth_headers for one variant row: its secret, endpoint and team."""
    if not variant.auth_secret:
        return {}
    return auth_headers(variant.auth_secret, secrets_dir, endpoint=variant.endpoint, team=team_of(variant))


def client_for(
    variant: Variant,
    *,
    verify: bool | str | None = None,
    fingerprint: bool = False,
    keep_text: bool = False,
) -> VariantClient:
    """The streaming client of one variant (SecretError when its secret is not configured);
    ``fingerprint``: its answers' fingerprints are recorded (a mirror replay's, for fidelity);
    ``keep_text``: their texts too (the experiment's fidelity.store_answers)."""
    return VariantClient(
        variant.endpoint,
        variant.model,
        variant.api,
        http2=variant.http2,
        verify=ca_verify() if verify is None else verify,
        allow=allowlist(),
        headers=variant_headers(variant),
        fingerprint=fingerprint,
        keep_text=keep_text,
    )


def counter_for(
    variants: Sequence[Variant], *, verify: bool | str | None = None
) -> Callable[[str, str, str], Awaitable[tuple[TokenCounter | None, str]]]:
    """``open_counter`` for replay.calibration.plan_prompts: its targets are (endpoint, model,
    api); a variant's secret and the allowlist go with the target's probe. A secret that is
    not configured makes that variant's counter unavailable (the plan falls back to its
    estimate; the preflight names the secret)."""
    secrets: dict[tuple[str, str, str], tuple[str, str]] = {}
    for v in variants:  # here, before the event loop: the team is read from the database
        secrets.setdefault((v.endpoint, v.model, v.api), (v.auth_secret, team_of(v) if v.auth_secret else ""))
    allow = allowlist()
    verify = ca_verify() if verify is None else verify

    async def open_counter(endpoint: str, model: str, api: str) -> tuple[TokenCounter | None, str]:
        secret, team = secrets.get((endpoint, model, api), ("", ""))
        try:
            headers = auth_headers(secret, endpoint=endpoint, team=team)
        except ValueError as exc:  # SecretError
            return None, str(exc)
        return await token_counter(endpoint, model, api, verify=verify, allow=allow, headers=headers)

    return open_counter
