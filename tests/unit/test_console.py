"""The web console without a server (services/gateway/console): its session tokens and CSRF
tokens, templates that escape every value, the pure view functions (who sees what, the
list's filters, gauges, replay), and the routes' security with fakes in place of NATS."""

from __future__ import annotations

import asyncio
import html.parser
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace

import jinja2
import msgspec
import nats.js.errors
import pytest
from starlette.responses import Response
from starlette.testclient import TestClient

from sbx_api import errors
from sbx_api.wire import Timeline, TimelineEntry
from services.gateway import auth, openapi
from services.gateway.console import asgi, routes, templating, tokens, views
from shared.contract import commands, events, states, subjects
from shared.domain import projections
from shared.infrastructure import eventstore, health
from tests import factories

NOW = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
T = NOW.timestamp()
OPERATOR_KEY = "operator-key-" + "o" * 32
ACME_KEY = "acme-key-" + "a" * 32


def signer(*, operator: str = OPERATOR_KEY, acme: str = ACME_KEY) -> tokens.Signer:
    return tokens.Signer(
        tokens.server_secret(operator),
        [(None, tokens.key_digest(operator)), ("acme", tokens.key_digest(acme))],
    )


# ---- tokens ------------------------------------------------------------------------


def test_a_token_proves_who_logged_in_until_it_expires():
    s = signer()
    token = s.issue(tokens.key_digest(ACME_KEY), "ann", T)
    who = s.check(token, T + 60)
    assert who is not None and (who.org, who.user, who.operator) == ("acme", "ann", False)
    assert s.check(token, T + tokens.TTL_SECONDS) is None  # expired
    operator = s.check(s.issue(tokens.key_digest(OPERATOR_KEY), "root", T), T)
    assert operator is not None and operator.operator and operator.org is None
    # The cookie never holds the key, nor anything of it an attacker could use offline.
    assert ACME_KEY not in token and tokens.key_digest(ACME_KEY).hex() not in token


def test_forged_tampered_or_orphaned_tokens_are_refused():
    s = signer()
    token = s.issue(tokens.key_digest(ACME_KEY), "ann", T)
    payload, mac = token.split(".")
    claims = tokens._unb64(payload).decode()
    for forged_claims in (claims.replace('"acme"', "null"), claims.replace('"ann"', '"bob"')):
        forged = tokens._b64(forged_claims.encode()) + "." + mac
        assert s.check(forged, T) is None
    for garbage in ("", ".", "a.b", token + ".x", "x" * 5000, payload + "." + tokens._b64(b"0" * 32), None):
        assert s.check(garbage, T) is None
    # A key rotated away ends its sessions; the other key's go on.
    rotated = signer(acme="acme-new-key-" + "n" * 32)
    assert rotated.check(token, T) is None
    assert rotated.check(s.issue(tokens.key_digest(OPERATOR_KEY), "root", T), T) is not None
    # Another server secret (another operator key) honours none.
    assert signer(operator="other-operator-" + "x" * 32).check(token, T) is None
    with pytest.raises(KeyError):
        s.issue(tokens.key_digest("not a configured key"), "eve", T)


def test_csrf_tokens_belong_to_one_binding():
    s = signer()
    mine = s.csrf("nonce-1")
    assert s.csrf_ok("nonce-1", mine)
    assert not s.csrf_ok("nonce-2", mine)
    assert not s.csrf_ok("nonce-1", None) and not s.csrf_ok(None, mine) and not s.csrf_ok("nonce-1", "")
    assert not s.csrf_ok("nonce-1", mine[:-1] + "é")


# ---- templates ---------------------------------------------------------------------


def error_page(message: object) -> str:
    return templating.render("error.html", title="Error", nav=None, code=400, message=message)


def test_characters_that_reorder_text_are_shown_as_escapes():
    """A command ``ls \u202egnp.exe`` would read as ``ls exe.png`` in a table cell."""
    page = error_page("ls \u202egnp.exe \u2066x\u2069 \u200f")
    assert not re.search("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]", page)
    assert "ls \\u202egnp.exe \\u2066x\\u2069 \\u200f" in page


def test_every_value_is_escaped_and_the_engine_is_strict():
    page = error_page("x\" onmouseover=\"alert(1)<script>alert(2)</script>{{ 'sbx' ~ 'tmpl' }}{% if 1 %}")
    assert "<script>alert" not in page and "&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "x&#34; onmouseover=&#34;alert(1)" in page
    # (values are never templates)
    assert "{{ &#39;sbx&#39; ~ &#39;tmpl&#39; }}{% if 1 %}" in page and "sbxtmpl" not in page
    assert "(HTTP 400)" in page and "None" not in error_page(None)  # None shows as nothing
    assert templating.ENV.autoescape is True
    with pytest.raises(jinja2.UndefinedError):
        templating.render("error.html", title="Error", nav=None, code=400)  # a value missing is an error
    for outside in ("../views.py", "/etc/passwd", "../templating.py"):
        with pytest.raises(jinja2.TemplateNotFound):
            templating.render(outside)


def test_no_template_or_route_marks_a_value_safe():
    """Autoescape holds only if nothing opts out: no ``|safe``, no ``autoescape false``, no
    ``Markup`` made from a value."""
    for path in templating.TEMPLATES.iterdir():
        text = path.read_text()
        assert not re.search(r"\|\s*safe\b|autoescape\s+false|\bMarkup\b", text), path.name
    for module in (routes, views, asgi, tokens):
        source = Path(module.__file__).read_text()
        assert "Markup" not in source and "markupsafe" not in source, module.__name__


def test_templates_have_no_inline_script_or_style():
    for path in templating.TEMPLATES.iterdir():
        text = path.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)|<style|\sstyle=|\son[a-z]+=|javascript:", text), (
            path.name
        )


# ---- views -------------------------------------------------------------------------


def session(sid: str, org: str | None = None, **more) -> states.SessionState:
    return factories.session_state(sid, org_id=org, **({"created_at": NOW, "updated_at": NOW} | more))


def sandbox(sid: str, **more) -> states.SandboxState:
    return factories.sandbox_state(sid, **({"created_at": NOW, "updated_at": NOW} | more))


def test_the_filters_and_an_organisation_bound_key():
    assert views.filters({"status": "stopped", "user": " ann "}, None) == views.Filters(
        status="stopped", user="ann"
    )
    assert views.filters({}, "acme").org == "acme"  # a bound key lists its organisation only
    with pytest.raises(errors.Forbidden):
        views.filters({"org": "globex"}, "acme")
    for bad in ({"status": "running"}, {"user": "x" * 200}, {"org": "a\x00b"}):
        with pytest.raises(errors.InvalidInput):
            views.filters(bad, None)
    assert views.Filters(status="active", org="a&b").query() == "status=active&org=a%26b"


def test_the_filters_form_and_a_sessions_actions():
    chosen = views.filters({"status": "stopped"}, "acme")
    form = views.filter_form("sessions", chosen, views.STATUSES, "active and stopped", "acme")
    assert (form.action, form.org_readonly, form.chosen.org) == ("/console/sessions", True, "acme")
    labels = [(o.value, o.label) for o in form.options]
    assert labels[:2] == [("", "active and stopped"), ("active", "active")]
    assert [o.value for o in form.options if o.selected] == ["stopped"]
    assert not views.filter_form("sandboxes", views.Filters(), (), "all", None).org_readonly
    actions = views.session_actions(session("a b/c"), "tok")
    assert actions == views.Actions(
        csrf="tok", stop="/console/sessions/a%20b%2Fc/stop", delete="/console/sessions/a%20b%2Fc/delete",
        can_stop=True,
    )  # fmt: skip
    assert views.session_actions(session("x", status="stopped"), "tok").can_stop is False
    assert views.session_actions(session("x", status="deleted"), "tok") is None


def test_session_rows_filter_and_hide_other_organisations():
    everyone = [
        session("a1", "acme", user_id="ann", image="python", sandbox_id="sb1", created_at=NOW),
        session("a2", "acme", status="stopped", created_at=NOW + timedelta(seconds=1)),
        session("a3", "acme", status="deleted"),
        session("g1", "globex"),
        session("n1", None),
    ]
    boxes = {"sb1": sandbox("sb1", image="python")}
    ids = lambda rows: [r.session_id for r in rows]  # noqa: E731
    assert ids(views.session_rows(everyone, boxes, views.Filters(), None)) == ["a1", "g1", "n1", "a2"]
    assert ids(views.session_rows(everyone, boxes, views.Filters(), "acme")) == ["a1", "a2"]
    assert ids(views.session_rows(everyone, boxes, views.Filters(status="deleted"), "acme")) == ["a3"]
    assert ids(views.session_rows(everyone, boxes, views.Filters(org="globex"), "acme")) == []
    assert ids(views.session_rows(everyone, boxes, views.Filters(user="ann", image="pyth"), None)) == ["a1"]
    row = views.session_rows(everyone, boxes, views.Filters(user="ann"), None)[0]
    assert (row.sandbox_id, row.sandbox_status, row.href) == ("sb1", "running", "/console/sessions/a1")
    assert views.href("sessions", "a/../b?c") == "/console/sessions/a%2F..%2Fb%3Fc"
    assert not views.visible_session(session("n1"), "acme") and views.visible_session(session("n1"), None)


def test_sandbox_rows_filter_and_show_their_sessions_owner():
    owners = {"a1": session("a1", "acme", user_id="ann"), "g1": session("g1", "globex")}
    boxes = [
        sandbox("sb-a", session_id="a1", image="python:3.12", created_at=NOW),
        sandbox("sb-g", session_id="g1", status="paused", created_at=NOW + timedelta(seconds=1)),
        sandbox("sb-idle", pool="default", created_at=NOW + timedelta(seconds=2)),
        sandbox("sb-gone", session_id="a1", status="deleted"),
    ]
    ids = lambda rows: [r.sandbox_id for r in rows]  # noqa: E731
    assert ids(views.sandbox_rows(boxes, owners, views.Filters(), None)) == ["sb-a", "sb-g", "sb-idle"]
    assert ids(views.sandbox_rows(boxes, owners, views.Filters(), "acme")) == ["sb-a"]
    assert ids(views.sandbox_rows(boxes, owners, views.Filters(status="deleted"), "acme")) == ["sb-gone"]
    assert ids(views.sandbox_rows(boxes, owners, views.Filters(status="paused"), None)) == ["sb-g"]
    assert ids(views.sandbox_rows(boxes, owners, views.Filters(image="python"), None)) == ["sb-a"]
    (row,) = views.sandbox_rows(boxes, owners, views.Filters(user="ann"), None)
    assert (row.session_id, row.org, row.user) == ("a1", "acme", "ann")
    assert views.filters({"status": "paused"}, None, views.SANDBOX_STATUSES).status == "paused"
    assert "lost" in views.SANDBOX_STATUSES


def snapshot(sid: str, session_id: str, org: str | None = None, **more) -> states.SnapshotState:
    fields = {"status": "ready", "sandbox_id": "sb", "digest": "d", "created_at": NOW, "updated_at": NOW}
    fields |= {"last_seq": 1} | more
    return states.SnapshotState(snapshot_id=sid, session_id=session_id, org_id=org, **fields)


def test_snapshot_rows_filter_hide_other_organisations_and_say_sizes():
    taken = [
        snapshot("s1", "a1", "acme", user_id="ann", size=1536, total_size=3 * 1024**2, layers=("x", "y")),
        snapshot("s2", "a2", "acme", created_at=NOW + timedelta(seconds=1), parent="s1", warm=5),
        snapshot("s3", "a1", "acme", status="deleted", delete_reason="retention"),
        snapshot("s4", "g1", "globex", image="python:3.12"),
        snapshot("s5", "n1"),
    ]
    ids = lambda rows: [r.snapshot_id for r in rows]  # noqa: E731
    assert ids(views.snapshot_rows(taken, views.Filters(), None)) == ["s1", "s4", "s5", "s2"]
    assert ids(views.snapshot_rows(taken, views.Filters(), "acme")) == ["s1", "s2"]
    assert ids(views.snapshot_rows(taken, views.Filters(status="deleted"), "acme")) == ["s3"]
    assert ids(views.snapshot_rows(taken, views.Filters(org="globex"), "acme")) == []
    assert ids(views.snapshot_rows(taken, views.Filters(image="python"), None)) == ["s4"]
    assert ids(views.snapshot_rows(taken, views.Filters(), "acme", session_id="a1")) == ["s1"]
    assert ids(views.snapshot_rows(taken, views.Filters(), "globex", session_id="a1")) == []
    row = views.snapshot_rows(taken, views.Filters(user="ann"), None)[0]
    assert (row.size, row.total, row.layers, row.org, row.warm) == ("1.5 KiB", "3.0 MiB", "2", "acme", "")
    assert views.snapshot_rows(taken, views.Filters(), "acme")[1].warm == "5"
    (gone,) = views.snapshot_rows(taken, views.Filters(status="deleted"), None)
    assert gone.status == "deleted (retention)"
    assert views.snapshot_rows(taken, views.Filters(status="ready"), None)[1].parent == ""
    assert views.filters({"status": "deleted"}, None, views.SNAPSHOT_STATUSES).status == "deleted"
    with pytest.raises(errors.InvalidInput):
        views.filters({"status": "active"}, None, views.SNAPSHOT_STATUSES)


def test_a_bound_key_sees_the_events_of_its_organisation_only():
    def meta(org=None, sid=None):
        return events.Meta(
            event_id="e" * 32, time=NOW, service="t", instance="t1", org_id=org, session_id=sid
        )

    by_acme = events.SessionStopped(meta=meta("acme"), session_id="a1")
    by_reaper = events.SessionStopped(meta=meta(), session_id="a1")
    pool = events.SandboxStarted(meta=meta(), sandbox_id="sb9")
    assert views.visible_event(by_acme, "acme", None)
    assert views.visible_event(by_reaper, "acme", "acme") and not views.visible_event(
        by_reaper, "acme", "globex"
    )
    assert not views.visible_event(pool, "acme", None) and views.visible_event(pool, None, None)
    ran = events.CommandExecuted(meta=meta(sid="a1"), session_id="a1", sandbox_id="sb1", tool="shell",
                                 command="echo <b>hi</b>", exit_code=0)  # fmt: skip
    record = views.audit_record(7, ran)
    assert (record.seq, record.type, record.session) == (7, "exec.completed", "a1")
    assert "command=echo <b>hi</b>" in record.summary  # text: the template escapes it
    rendered = templating.render(
        "audit.html", title="Audit", nav=None, shown=1, scope="all", stream="/s", records=[record]
    )
    assert "<b>" not in rendered and "&lt;b&gt;hi" in rendered
    assert '<a href="/console/sessions/a1">a1</a>' in rendered


def test_timeline_rows_as_the_script_renders_them():
    entry = TimelineEntry(seq=3, time=NOW, kind="command", type="exec.completed", summary="shell: ls",
                          org_id="acme", user_id="ann")  # fmt: skip
    assert views.timeline_row(entry) == {
        "seq": "3", "time": "2026-12-03T09:00:00Z", "kind": "command", "summary": "shell: ls",
        "who": "acme / ann", "incarnation": "",
    }  # fmt: skip
    again = msgspec.structs.replace(entry, incarnation=2)
    assert views.timeline_row(again)["incarnation"] == "2"


def report(service: str, instance: str, age: float, **details: str) -> health.HealthReport:
    return health.HealthReport(
        service=service, instance=instance, pid=1, host="h", version="1", status="ok", started_at=NOW,
        reported_at=NOW - timedelta(seconds=age), interval=1.0, details=details,
    )  # fmt: skip


def test_instances_health_and_gauges():
    reports = [report("gateway", "g1", 0.5), report("pool-manager", "p1", 10, **{"idle:default": "2"})]
    gone = states.InstanceState(service="executor", instance="e1", status="running", pid=9, host="h",
                                version="1", started_at=NOW, last_seq=1)  # fmt: skip
    rows = views.instance_rows(reports, [gone], NOW)
    assert [(r.service, r.liveness) for r in rows] == [("gateway", "ok"), ("pool-manager", "stale"),
                                                       ("executor", "no report")]  # fmt: skip
    boxes = [
        sandbox("p1", pool="default", proxy_id="px1"),
        sandbox("p2", pool="default", session_id="s1", proxy_id="px1"),
        sandbox("p3", pool="default", status="requested"),
        sandbox("own", proxy_id="px2", status="paused"),
    ]
    proxies = [
        states.ProxyState(proxy_id=p, status=st, endpoint="e", started_at=NOW, updated_at=NOW, last_seq=1)
        for p, st in (("px1", "running"), ("px2", "draining"), ("px3", "stopped"))
    ]
    shown = views.gauges(boxes, proxies, reports)
    pool = {g.name: g.value for g in shown.pool}
    assert pool["pool sandboxes: running"] == 2 and pool["pool sandboxes: requested"] == 1
    assert pool["idle (ready to be claimed)"] == 1 and pool["idle in pool default"] == 1
    assert pool["default: idle, as p1 counts"] == 2
    fleet = {g.name: g.value for g in shown.proxies}
    assert fleet["proxies: running"] == 1 and fleet["proxies: draining"] == 1
    assert (
        fleet["sandboxes on px1"] == 2 and fleet["sandboxes on px2"] == 1 and "sandboxes on px3" not in fleet
    )


def test_replay_results():
    @dataclass
    class Diff:
        text: str

        def describe(self) -> str:
            return self.text

    good = views.replay_view(10, 0.5, {"session": 2}, [])
    assert good.ok and good.lines == ["projections match the event stream"] and "10 events" in good.headline
    bad = views.replay_view(10, 0.5, {"session": 2}, [Diff("session s1: status: stream='a' kv='b'")])
    assert (
        not bad.ok
        and bad.lines[0].startswith("session s1")
        and "1 projection entries differ" in bad.lines[-1]
    )


def test_credentials_in_urls_are_not_shown():
    assert views.redact("git clone https://x-access:ghs_abc@github.com/o/r") == (
        "git clone https://…@github.com/o/r"
    )
    assert (
        views.redact("a=HTTP://u@h b=mailto:x@y.z c=https://h/p@v")
        == "a=HTTP://…@h b=mailto:x@y.z c=https://h/p@v"
    )
    entry = TimelineEntry(seq=1, time=NOW, kind="command", type="exec.completed",
                          summary="shell: curl https://user:pw@example.com/")  # fmt: skip
    assert "pw" not in views.timeline_row(entry)["summary"]
    ran = events.CommandExecuted(
        meta=events.Meta(event_id="e" * 32, time=NOW, service="t", instance="t1"),
        session_id="s", sandbox_id="sb", tool="shell", command="curl https://user:pw@example.com/",
    )  # fmt: skip
    assert "pw" not in views.audit_record(1, ran).summary
    (row,) = views.instance_rows(
        [report("proxy-scaler", "p1", 0, upstream="http://u:pw@proxy:3128")], [], NOW
    )
    assert "pw" not in row.details


def test_the_console_is_not_in_the_openapi_document():
    paths = openapi.document("test")["paths"]
    assert paths and not [p for p in paths if p.startswith("/console")]


def test_the_name_given_at_login():
    assert views.user_name("  ann ") == "ann"
    for bad in ("", "   ", None, "a\x07b", "x" * 300):
        with pytest.raises(errors.InvalidInput):
            views.user_name(bad)


# ---- routes (fakes for NATS) -------------------------------------------------------


class FakeSessions:
    def __init__(self, *found: states.SessionState) -> None:
        self.found = {s.session_id: s for s in found}

    async def all(self):
        return dict(self.found)

    async def get(self, sid):
        return self.found.get(sid)


class FakeClient:
    def __init__(self) -> None:
        self.sent: list[commands.SessionCommand] = []

    async def session(self, command):
        self.sent.append(command)
        return None


class FakeHistory:
    """The API's timeline route: one entry whose command is HTML."""

    async def timeline(self, request):
        assert request.scope.get("sbx.org") == "acme" and request.query_params["after"] == "0"
        entry = TimelineEntry(seq=4, time=NOW, kind="command", type="exec.completed",
                              summary="shell: echo '<img src=x onerror=alert(1)>'")  # fmt: skip
        page = Timeline(
            session_id=request.path_params["session_id"], entries=[entry], next_after=4, more=False
        )
        return Response(msgspec.json.encode(page), media_type="application/json")


class NoBuckets:
    async def key_value(self, bucket):
        raise nats.js.errors.NotFoundError


@pytest.fixture
def console():
    fake = FakeClient()
    c = routes.Console(
        keys=auth.KeyCheck(OPERATOR_KEY, (("acme", ACME_KEY),)),
        signer=signer(),
        ctx=SimpleNamespace(js=NoBuckets(), store=SimpleNamespace(topology=subjects.Topology("t"))),  # type: ignore[arg-type]
        sessions=FakeSessions(session("a1", "acme", user_id="<i>ann</i>"), session("g1", "globex")),  # type: ignore[arg-type]
        client=fake,  # type: ignore[arg-type]
        history=FakeHistory(),  # type: ignore[arg-type]
        clock=lambda: T,
    )
    with TestClient(c.app(), base_url="https://testserver") as http:
        http.fake = fake  # type: ignore[attr-defined]
        http.app_state = SimpleNamespace(console=c)  # type: ignore[attr-defined]
        yield http


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def login(http: TestClient, key: str, user: str = "ops"):
    form = http.get("/console/login")
    return http.post("/console/login", data={"csrf": csrf_of(form.text), "key": key, "user": user},
                     follow_redirects=False)  # fmt: skip


def test_login_sets_a_safe_cookie_and_every_answer_is_locked_down(console):
    assert console.get("/console/sessions", follow_redirects=False).headers["location"] == "/console/login"
    refused = login(console, "wrong-" + OPERATOR_KEY)
    assert refused.status_code == 401 and "not valid" in refused.text and "wrong-" not in refused.text
    answer = login(console, OPERATOR_KEY)
    assert answer.status_code == 303
    cookie = answer.headers["set-cookie"].lower()
    assert (
        "httponly" in cookie
        and "samesite=strict" in cookie
        and "secure" in cookie
        and "path=/console" in cookie
    )
    assert OPERATOR_KEY.lower() not in cookie
    page = console.get("/console/sessions")
    assert page.status_code == 200
    assert page.headers["content-security-policy"] == asgi.CSP and page.headers["x-frame-options"] == "DENY"
    assert "frame-ancestors 'none'" in asgi.CSP and "'unsafe-inline'" not in asgi.CSP
    assert "&lt;i&gt;ann&lt;/i&gt;" in page.text and "<i>" not in page.text and OPERATOR_KEY not in page.text
    assert "g1" in page.text


def test_forms_need_their_csrf_token_and_actions_record_who(console):
    login(console, ACME_KEY, user="ann")
    page = console.get("/console/sessions/a1")
    assert page.status_code == 200 and "g1" not in console.get("/console/sessions").text
    assert "<img" not in page.text and "&lt;img src=x onerror=alert(1)&gt;" in page.text
    assert 'data-stream="/console/sessions/a1/timeline/stream?after=4"' in page.text
    assert console.get("/console/sessions/g1").status_code == 404  # another organisation's
    assert console.get("/console/system").status_code == 403  # the operator's only
    for data in ({}, {"csrf": "forged"}, {"csrf": signer().csrf("another-login")}):
        assert console.post("/console/sessions/a1/stop", data=data).status_code == 403
    assert console.fake.sent == []
    stopped = console.post("/console/sessions/a1/stop", data={"csrf": csrf_of(page.text)},
                           follow_redirects=False)  # fmt: skip
    assert stopped.status_code == 303
    (command,) = console.fake.sent
    assert isinstance(command, commands.StopSession) and command.session_id == "a1"
    assert command.actor == commands.Actor(via="console", org_id="acme", user_id="ann")
    assert command.correlation_id.startswith("console:")
    assert console.post("/console/sessions/g1/stop", data={"csrf": csrf_of(page.text)}).status_code == 404
    assert console.get("/console/sessions/a1/stop").status_code == 405
    logout = console.post("/console/logout", data={"csrf": csrf_of(page.text)}, follow_redirects=False)
    assert logout.status_code == 303
    assert console.get("/console/sessions", follow_redirects=False).status_code == 303


def test_live_streams_are_bounded_and_need_a_login(console):
    assert console.get("/console/audit/stream").status_code == 401
    assert console.get("/console/sessions/a1/timeline/stream").status_code == 401
    login(console, OPERATOR_KEY)
    console.app_state.console._streams = routes.STREAMS_MAX
    full = console.get("/console/audit/stream")
    assert full.status_code == 503 and full.headers["retry-after"]


def test_the_audit_page_places_a_snapshots_event_in_the_life_that_took_it():
    """An org-less event of an old life's snapshot (the operator deleting it), read long after
    the snapshot's creation, is the old owner's: the new owner of the id never sees it."""
    import asyncio

    from shared.domain import timeline as rules
    from shared.infrastructure import eventstore

    now = datetime(2026, 12, 3, tzinfo=UTC)

    def meta(org: str | None) -> events.Meta:
        return events.Meta(
            event_id="e" * 32, time=now, service="t", instance="t1", org_id=org, session_id="x"
        )

    own_subject = [
        (1, events.SessionCreated(meta=meta("acme"), session_id="x", org_id="acme")),
        (
            2,
            events.SessionSandboxAssigned(
                meta=meta("acme"), session_id="x", sandbox_id="sb-a", image="default"
            ),
        ),
        (9, events.SessionDeleted(meta=meta("acme"), session_id="x")),
        (20, events.SessionCreated(meta=meta("globex"), session_id="x", org_id="globex")),
    ]
    first = events.SnapshotCreated(
        meta=meta("acme"),
        snapshot_id="snap-acme",
        session_id="x",
        sandbox_id="sb-a",
        org_id="acme",
        digest="d",
    )

    class Reader:
        async def members(self, sid: str, viewer: str | None = None) -> rules.Membership:
            found = rules.Membership(sid, viewer)
            for seq, event in own_subject:
                found.learn(seq, event)
            return found

        async def place_snapshot(self, lives, event) -> None:  # (what the real reader reads: seq 5)
            if isinstance(event, events.SnapshotEvent) and not lives.knows_snapshot(event.snapshot_id):
                lives.learn(5, first)

    console = object.__new__(routes.Console)
    console.history = SimpleNamespace(reader=Reader())
    globex = tokens.Identity(org="globex", user="g", expires=0, nonce="n")
    deleted = events.SnapshotDeleted(meta=meta(None), snapshot_id="snap-acme", session_id="x")
    stored = eventstore.Stored(seq=500, subject="t.events.snapshot.snap-acme", prev_seq=5, event=deleted)
    assert asyncio.run(console.sees(stored, globex, {})) is False


# ---- hostile text on every page ------------------------------------------------------

HOSTILE = "\"'><script>window.x=1</script><img src=x onerror=alert(1)>{{ 'sbx'~'tmpl' }}{% if 1 %}</td>&amp;"
"""What a tenant may write into a name, an image, a command or a report: a tag, quotes that
would end an attribute, template syntax and an entity."""


class Parsed(html.parser.HTMLParser):
    """A page's elements, attributes and text as a browser would read them."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text = ""
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text += data


def assert_inert(page: str, where: str, times: int) -> Parsed:
    """No element or attribute came from the hostile text, and it shows as itself, as many
    times as the page has fields holding it."""
    parsed = Parsed(page)
    scripts = [attrs for tag, attrs in parsed.tags if tag == "script"]
    assert scripts == [{"src": "/console/static/console.js", "defer": None}], where
    assert not [tag for tag, _ in parsed.tags if tag in ("img", "style", "iframe", "object")], where
    assert not [name for _, attrs in parsed.tags for name in attrs if name.startswith("on")], where
    assert parsed.text.count(HOSTILE) == times, (where, parsed.text)
    assert "sbxtmpl" not in parsed.text, where  # {{ 'sbx'~'tmpl' }} stayed text
    return parsed


class Store:
    """A projection's store, as the routes read it."""

    def __init__(self, found: dict) -> None:
        self.found = found

    async def all(self):
        return dict(self.found)

    async def get(self, key):
        return self.found.get(key)


class Events:
    """The event store, as the audit page and its stream read it: these events, then the end."""

    def __init__(self, *found: events.Event) -> None:
        self.stored = [
            eventstore.Stored(seq=n, subject="s", prev_seq=0, event=e) for n, e in enumerate(found, 1)
        ]

    async def last_seq(self) -> int:
        return len(self.stored)

    async def read(self, subject, start_seq: int = 1, follow: bool = False):
        for stored in self.stored[start_seq - 1 :]:
            yield stored


class HostileHistory:
    async def timeline(self, request):
        entry = TimelineEntry(seq=1, time=NOW, kind="command", type="exec.completed", summary=HOSTILE,
                              org_id=HOSTILE, user_id=HOSTILE)  # fmt: skip
        page = Timeline(session_id="h1", entries=[entry], next_after=1, more=True)
        return Response(msgspec.json.encode(page), media_type="application/json")


class HostileConsole(routes.Console):
    reports: list[health.HealthReport] = []

    async def health(self):
        return self.reports


def test_hostile_text_in_every_field_stays_text_on_every_page():
    """Names, images, commands, event fields, reports and replay results holding a tag,
    quotes and template syntax: on every page, no element or attribute comes of them and
    they read as written (the live streams send JSON, which the script sets as text)."""
    h = HOSTILE
    meta = events.Meta(
        event_id="e" * 32, time=NOW, service=h, instance=h, org_id=h, user_id=h, session_id="h1"
    )
    ran = events.CommandExecuted(meta=meta, session_id=h, sandbox_id=h, tool="shell", command=h, exit_code=0)
    c = HostileConsole(
        keys=auth.KeyCheck(OPERATOR_KEY, (("acme", ACME_KEY),)),
        signer=signer(),
        ctx=SimpleNamespace(store=Events(ran)),  # type: ignore[arg-type]
        sessions=FakeSessions(
            session("h1", h, user_id=h, image=h, sandbox_id=h, forked_from=h, metadata={h: h})
        ),  # type: ignore[arg-type]
        client=FakeClient(),  # type: ignore[arg-type]
        history=HostileHistory(),  # type: ignore[arg-type]
        clock=lambda: T,
    )
    box = sandbox(
        h, session_id="h1", image=h, image_digest=h, backend=h, pool=h, snapshot=h, proxy_id=h, error=h
    )
    taken = snapshot(h, "h1", h, user_id=h, image=h, parent=h, delete_reason=h)
    proxy = states.ProxyState(
        proxy_id=h, status="running", endpoint=h, started_at=NOW, updated_at=NOW, last_seq=1
    )
    gone = states.InstanceState(service=h, instance=h + "2", status="running", pid=1, host=h, version=h,
                                started_at=NOW, last_seq=1)  # fmt: skip
    c._stores = {
        projections.SANDBOXES.kind: Store({h: box}),
        projections.SNAPSHOTS.kind: Store({h: taken}),
        projections.PROXIES.kind: Store({h: proxy}),
        projections.INSTANCES.kind: Store({h: gone}),
    }
    c.reports = [
        msgspec.structs.replace(report("pool-manager", h, 1, **{"idle:" + h: "1", h: h}), host=h, version=h)
    ]
    with TestClient(c.app(), base_url="https://testserver") as http:
        assert login(http, OPERATOR_KEY, user=h).status_code == 303  # the name shows on every page
        for path, times in (  # (each page: the fields holding it, and the name in the navigation)
            ("/console/sessions", 5),  # organisation, user, image, sandbox
            ("/console/sandboxes", 8),  # id, image, backend, pool, organisation, user, proxy
            ("/console/snapshots", 7),  # id, status's reason, organisation, user, image, parent
            ("/console/sessions/h1", 18),  # details, sandbox, snapshot, the timeline's entry
            ("/console/audit", 8),  # the command's event: session, summary, who, by
            ("/console/system", 14),  # instances, reports' details, pool and proxy gauges
        ):
            page = http.get(path)
            assert page.status_code == 200, (path, page.text)
            assert_inert(page.text, path, times)
        # In attributes too: a filter's value reads back as written.
        listed = http.get("/console/sessions", params={"image": h, "user": h})
        fields = {attrs.get("id"): attrs for _, attrs in assert_inert(listed.text, "filtered", 5).tags}
        assert fields["f-image"]["value"] == h and fields["f-user"]["value"] == h
        # The replay result (from the route, as a failed verification shows it).
        who = c.signer.check(http.cookies.get(routes.COOKIE), T)
        differences = [SimpleNamespace(describe=lambda: h)]
        view = views.replay_view(3, 0.1, {h: 1}, differences)
        shown = asyncio.run(c.system(None, who, view))  # type: ignore[arg-type]
        assert_inert(bytes(shown.body).decode(), "replay", 16)  # the system page's 14, headline, line
        # The live audit stream: JSON the script sets as text, the hostile text intact in it.
        streamed = http.get("/console/audit/stream", params={"after": "0"})
        (record,) = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert h in msgspec.json.decode(record.removeprefix("data: "))["summary"]
