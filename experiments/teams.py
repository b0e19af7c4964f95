"""Who acts on which experiments: roles say what a user may do, teams on which experiments.

Roles stay the auth groups (product, sre, analyst; docs/security.md, "Roles"). A team (models.Team) owns
experiments; a product or analyst user is a member of one or more teams and acts on (product) or
reads (analyst) the experiments of those teams only. Users who may change traffic (the sre role,
TRAFFIC_PERMISSION) operate the weights, rollouts and replays of every experiment, so they act
on every team's; superusers hold every permission. A change made with no user (the operator's
command line without ``--as``, the platform's own processes, which name themselves by a string)
acts on every team too: a shell on the host reaches the database anyway.

The web glue filters what it reads through ``visible_experiments`` (and the ``experiment``
relations of runs and searches through ``via``), so another team's experiment is missing, a
404, never a 403 that would confirm its key; services check ``may_act_on`` again before a
change, whoever calls them.

``ABPLAT_DEFAULT_TEAM`` (settings.DEFAULT_TEAM, "default"): a user given the product or analyst
role joins it (created when missing), so a platform with one team needs no administration; and
a document that names no team from an author in no single team who acts on every team goes
there. Empty: neither; an administrator puts users in teams (admin, Teams).
"""

from __future__ import annotations

from django.conf import settings
from django.db.models import Q, QuerySet

from experiments.models import AuditEntry, Experiment, Team

# Roles whose users act within their teams; sre and superusers act on all.
TEAM_ROLES = ("product", "analyst")
# Acting on every team's experiments: the traffic permission (experiments.services), held by the
# sre role, which operates the weights, rollout plans and replays of every experiment.
ALL_TEAMS_PERMISSION = "experiments.change_weights"


def default_team_name() -> str:
    return settings.DEFAULT_TEAM


def is_operator(actor) -> bool:
    """No user: the operator's command line, or a process naming itself (a string)."""
    return actor is None or not hasattr(actor, "has_perm")


def acts_on_all_teams(actor) -> bool:
    return is_operator(actor) or bool(actor.has_perm(ALL_TEAMS_PERMISSION))


def _member(actor) -> bool:
    return bool(getattr(actor, "is_authenticated", False)) and getattr(actor, "pk", None) is not None


def teams_of(actor) -> QuerySet[Team]:
    """The teams ``actor`` is a member of (none for an anonymous caller)."""
    if not _member(actor):
        return Team.objects.none()
    return Team.objects.filter(members=actor)


def usable_teams(actor) -> QuerySet[Team]:
    """The teams ``actor`` may put an experiment in: every team for those who act on all."""
    return Team.objects.all() if acts_on_all_teams(actor) else teams_of(actor)


def may_use_team(actor, team: Team) -> bool:
    return acts_on_all_teams(actor) or (_member(actor) and team.members.filter(pk=actor.pk).exists())


def may_act_on(actor, experiment: Experiment) -> bool:
    """Whether ``actor`` may act on (or, with a reading role, read) ``experiment``: its team's
    members, and those who act on every team. The role's own permission is checked apart."""
    return acts_on_all_teams(actor) or (
        _member(actor) and Team.objects.filter(pk=experiment.team_id, members=actor).exists()
    )


def visible_experiments(actor, queryset: QuerySet | None = None, *, via: str = "") -> QuerySet:
    """``queryset`` (default: every experiment) narrowed to the experiments of ``actor``'s
    teams; unchanged for those who act on every team. ``via``: the relation from the queryset's
    model to its experiment (``"experiment"`` for replay runs and capacity searches)."""
    qs = Experiment.objects.all() if queryset is None else queryset
    if acts_on_all_teams(actor):
        return qs
    if not _member(actor):
        return qs.none()
    prefix = f"{via}__" if via else ""
    return qs.filter(**{f"{prefix}team__in": teams_of(actor)})


def visible_audit(actor, queryset: QuerySet | None = None) -> QuerySet:
    """Audit entries ``actor`` may read: those of their teams' experiments, and of their teams'
    deleted drafts (the entry's own team). Everything for those who act on every team."""
    qs = AuditEntry.objects.all() if queryset is None else queryset
    if acts_on_all_teams(actor):
        return qs
    if not _member(actor):
        return qs.none()
    teams = teams_of(actor)
    return qs.filter(Q(experiment__team__in=teams) | Q(experiment__isnull=True, team__in=teams))


def join_default_team(sender, instance, action, reverse, model, pk_set, **kwargs) -> None:
    """m2m_changed of User.groups: users put in a team role (from either side of the relation)
    join the default team, when one is configured."""
    from django.contrib.auth.models import Group

    name = default_team_name()
    if action != "post_add" or not pk_set or not name:
        return
    if reverse:  # group.user_set.add(users)
        if instance.name not in TEAM_ROLES:
            return
        users = list(pk_set)
    else:  # user.groups.add(groups)
        if not Group.objects.filter(pk__in=pk_set, name__in=TEAM_ROLES).exists():
            return
        users = [instance.pk]
    team, _ = Team.objects.get_or_create(name=name)
    team.members.add(*users)
