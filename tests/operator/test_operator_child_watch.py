"""Drift repair from the children's own watch events (kvpilot.operator.child_watch): which
events ask for a reconcile of the owner, with the children the reconciler itself renders.
The real watch and reconcile, against the API server, run in test_operator_e2e.py
(test_a_deleted_child_comes_back_and_a_hand_edit_is_undone, with a 600 s resync)."""
from __future__ import annotations

import asyncio
import copy

import pytest
import yaml
from kube.tools import ROOT

from kvpilot.api.spec import InferenceServiceSpec
from kvpilot.operator.child_watch import owner_to_repair
from kvpilot.operator.reconcile import Context, OperatorConfig, desired_children

KEY = ("ns", "smollm2")


class Kube:
    """A client whose GET of the owner answers `owner` (None: gone)."""

    def __init__(self, owner: dict | None):
        self.owner = owner
        self.gets: list[str] = []

    async def get(self, path: str) -> dict | None:
        self.gets.append(path)
        return self.owner


def isvc() -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "inferenceservice-smollm2.yaml").read_text())
    doc["metadata"] = {"name": KEY[1], "namespace": KEY[0], "uid": "u-1", "generation": 2}
    return doc


def setup(owner_on_get: dict | None = None, reconciled_generation: int | None = 2) -> tuple[Context, dict, Kube]:
    body = isvc()
    kube = Kube(owner_on_get)
    ctx = Context(kube=kube, config=OperatorConfig.from_env({}))  # type: ignore[arg-type]
    ctx.known[KEY] = body
    if reconciled_generation is not None:
        ctx.reconciled_generation[KEY] = reconciled_generation
    return ctx, body, kube


def child(body: dict, kind: str) -> dict:
    """The child of `kind` as the reconciler renders it, as the API server would send it back
    (defaults and a status added)."""
    spec = InferenceServiceSpec.from_dict(body["spec"])
    rendered = next(c for c in desired_children(body, spec, OperatorConfig.from_env({}), podmonitor=False)
                    if c["kind"] == kind)
    sent = copy.deepcopy(rendered)
    sent["metadata"]["resourceVersion"] = "7"
    sent.setdefault("status", {})["observed"] = True
    return sent


def ask(ctx: Context, event_type: str | None, obj: dict) -> dict | None:
    return asyncio.run(owner_to_repair(ctx, event_type, obj))


@pytest.mark.parametrize("kind", ["Deployment", "ConfigMap", "Service", "NetworkPolicy"])
def test_an_edit_away_from_the_spec_asks_for_the_owner_and_one_that_still_covers_it_does_not(kind):
    ctx, body, kube = setup()
    unchanged = child(body, kind)
    assert ask(ctx, "MODIFIED", unchanged) is None  # server defaults and status are not drift
    edited = copy.deepcopy(unchanged)
    edited["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "someone"
    edited.setdefault("spec", {})["tampered"] = True
    if kind == "ConfigMap":
        edited["data"] = {k: "tampered" for k in unchanged["data"]}
    if kind == "Deployment":
        edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"
    assert ask(ctx, "MODIFIED", edited) is body
    assert kube.gets == []  # an edit is judged from the event alone


def test_a_deleted_child_asks_for_its_owner_only_while_the_owner_lives():
    ctx, body, kube = setup(owner_on_get=isvc())
    assert ask(ctx, "DELETED", child(body, "Service")) is body
    assert kube.gets == ["/apis/kvpilot.dev/v1alpha1/namespaces/ns/inferenceservices/smollm2"]
    ctx, body, _ = setup(owner_on_get=None)  # the garbage collector removing an owner's children
    assert ask(ctx, "DELETED", child(body, "Service")) is None
    going = isvc()
    going["metadata"]["deletionTimestamp"] = "2026-11-27T00:00:00Z"
    ctx, body, _ = setup(owner_on_get=going)
    assert ask(ctx, "DELETED", child(body, "Service")) is None


def test_added_events_and_relistings_ask_nothing():
    ctx, body, kube = setup(owner_on_get=isvc())
    edited = child(body, "Service")
    edited["spec"]["ports"] = []
    for event_type in ("ADDED", None):  # None: an object of the watch's initial listing (Kopf)
        assert ask(ctx, event_type, edited) is None
    assert kube.gets == []


def test_nothing_is_repaired_before_the_owners_generation_is_reconciled():
    """A create or update handler still to run will render the child anew: a child event seen
    meanwhile (the old Deployment against the new spec) is not drift."""
    for reconciled in (None, 1):
        ctx, body, _ = setup(reconciled_generation=reconciled)
        edited = child(body, "Service")
        edited["spec"]["ports"] = []
        assert ask(ctx, "MODIFIED", edited) is None


def test_a_child_of_another_owner_or_of_a_spec_that_cannot_run_is_left_alone():
    ctx, body, _ = setup()
    foreign = child(body, "Service")
    foreign["spec"]["ports"] = []
    foreign["metadata"]["ownerReferences"][0]["uid"] = "someone-else"  # same name, another owner (recreated)
    assert ask(ctx, "MODIFIED", foreign) is None
    unknown = child(body, "Service")
    unknown["metadata"]["labels"]["kvpilot.dev/inferenceservice"] = "not-seen"
    assert ask(ctx, "MODIFIED", unknown) is None
    ctx, body, _ = setup()
    edited = child(body, "Service")
    edited["spec"]["ports"] = []
    body["spec"]["engine"]["tensorParallelSize"] = 7  # invalid: its Failed status says why, no children
    assert ask(ctx, "MODIFIED", edited) is None


def test_what_a_failed_reconcile_did_is_still_announced(monkeypatch):
    """One Event per reason for a reconcile, posted even when a later step fails: the retry finds
    those children done and would say nothing of them."""
    from kvpilot.api.kube import ApiError
    from kvpilot.operator import reconcile as module

    ctx, body, _ = setup()
    posted: list[tuple[str, str]] = []

    async def ensure_children(ctx, body, spec, cause, done, logger):
        done["Created"].append("created ConfigMap smollm2-engine")
        raise ApiError(500, "InternalError", "boom")

    async def announce(kube, body, in_handler, type_, reason, message):
        posted.append((reason, message))

    monkeypatch.setattr(module, "ensure_children", ensure_children)
    monkeypatch.setattr(module, "announce", announce)
    with pytest.raises(ApiError):
        asyncio.run(module.reconcile(ctx, body, "create", None))
    assert posted == [("Created", "created ConfigMap smollm2-engine")]
