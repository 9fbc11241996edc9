"""The web console in a real browser against a real `sbx up` (issue 21, item 5): Debian's
chromium, headless, driven by Playwright (never its own browser download).

A wrong key is refused, the right one logs in (a cookie that is not the key); the list
filters; a session's page shows a command an MCP agent runs as it happens, without a
reload; stopping it from the page records the operator's identity; a form post without
its CSRF token is refused; every page has its Content-Security-Policy and the browser
reports no error on any; HTML in ids, names and commands stays text; a key bound to an
organisation sees only its organisation, its audit stream too; replay --verify runs from
the page. Screenshots of the key pages are saved under the test's tmp dir (paths printed).
"""

from __future__ import annotations

import shutil
import urllib.parse
import uuid
from pathlib import Path

import httpx
import pytest

from tests import support
from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack

playwright = pytest.importorskip(
    "playwright.async_api", reason="playwright is a dev extra (scripts/setup --dev)"
)

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

ACME_KEY = "acme-console-key-" + uuid.uuid4().hex
GLOBEX_KEY = "globex-console-key-" + uuid.uuid4().hex
OPERATOR_NAME = "Olga Operator"
WAIT = 30_000
"""How long (ms) the browser waits for what must come: a bound, not a target."""
REFUSED = "error: Failed to load resource: the server responded with a status of {}"
"""What the browser logs for a page answered with an error status (expected where we ask for one)."""
HOSTILE = '<img src=x onerror="window.__xss=1">'


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    keys = state.parent / "org-keys"
    keys.write_text(f"acme {ACME_KEY}\nglobex {GLOBEX_KEY}\n")
    with running_stack(state, SBX_ORG_KEYS=str(keys)) as (_, url):
        yield url, (state / "api-key").read_text().strip()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


@pytest.fixture(scope="module")
def rest(stack):
    url, key = stack
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
async def browser():
    async with playwright.async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        yield chromium
        await chromium.close()


class Tab:
    """A browser context and its page, with everything the browser reported as wrong."""

    def __init__(self, context, page, base: str) -> None:
        self.context, self.page, self.base = context, page, base
        self.problems: list[str] = []
        page.on(
            "console", lambda m: self.problems.append(f"{m.type}: {m.text}") if m.type == "error" else None
        )
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))

    async def goto(self, path: str):
        return await self.page.goto(self.base + path)

    async def login(self, key: str, name: str = OPERATOR_NAME):
        await self.goto("/console/login")
        await self.page.fill("#key", key)
        await self.page.fill("#user", name)
        await self.page.press("#user", "Enter")  # the form is usable from the keyboard
        await self.page.wait_for_url("**/console/sessions")


@pytest.fixture
async def tab(browser, stack):
    context = await browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(WAIT)
    yield Tab(context, page, stack[0])
    await context.close()


async def shot(tab: Tab, shots: Path, name: str, capsys) -> None:
    path = shots / f"{name}.png"
    await tab.page.screenshot(path=str(path), full_page=True)
    with capsys.disabled():
        print(f"\nscreenshot: {path}")


async def test_a_wrong_key_is_refused_and_the_right_one_gives_a_cookie_that_is_not_it(
    tab, stack, shots, capsys
):
    _, key = stack
    first = await tab.goto("/console")
    assert tab.page.url.endswith("/console/login") and first.status == 200
    await shot(tab, shots, "login", capsys)

    await tab.page.fill("#key", "not-the-key-" + key)
    await tab.page.fill("#user", OPERATOR_NAME)
    async with tab.page.expect_response(lambda r: r.request.method == "POST") as answer:
        await tab.page.click("button[type=submit]")
    assert (await answer.value).status == 401
    await playwright.expect(tab.page.locator(".message.error")).to_contain_text("not valid")
    assert not [c for c in await tab.context.cookies() if c["name"] == "sbx_console"]
    assert key not in await tab.page.content()
    assert tab.problems == [REFUSED.format("401 (Unauthorized)")]  # (the browser logs the 401 itself)
    tab.problems.clear()

    await tab.login(key)
    assert tab.page.url.endswith("/console/sessions")
    (cookie,) = [c for c in await tab.context.cookies() if c["name"] == "sbx_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert key not in cookie["value"] and key not in await tab.page.content()
    assert await tab.page.evaluate("document.cookie") == ""  # not readable by scripts
    # The API does not take the console's cookie: it wants the key.
    api = await tab.context.request.get(tab.base + "/v1/sessions")
    assert api.status == 401
    assert tab.problems == [], tab.problems


async def test_filter_open_watch_a_command_live_and_stop_the_session(tab, stack, rest, shots, capsys):
    url, key = stack
    for sid, org, user in (("con-a", "acme", "ann"), ("con-b", "globex", "bob"), ("con-c", "acme", "carl")):
        created = rest.post("/v1/sessions", json={"session_id": sid, "org_id": org, "user_id": user})
        assert created.status_code == 201, created.text
    await tab.login(key)

    # Filter the list (from the keyboard: fill, then Enter submits the filters form).
    await tab.page.fill("#f-user", "ann")
    await tab.page.press("#f-user", "Enter")
    await tab.page.wait_for_url("**/console/sessions?*user=ann*")
    table = tab.page.locator("#sessions tbody")
    await playwright.expect(table.locator("tr")).to_have_count(1)
    await playwright.expect(table).to_contain_text("con-a")
    await tab.page.select_option("#f-status", "stopped")
    await tab.page.fill("#f-user", "")
    await tab.page.click(".filters button[type=submit]")
    await tab.page.wait_for_url("**/console/sessions?status=stopped&*")
    await playwright.expect(table).not_to_contain_text("con-a")
    await tab.goto("/console/sessions?org=acme")
    await playwright.expect(table).to_contain_text("con-c")
    await playwright.expect(table).not_to_contain_text("con-b")
    await shot(tab, shots, "sessions-filtered", capsys)

    # Open the session, then an agent runs a command: it appears without a reload.
    await tab.page.click("a[href='/console/sessions/con-a']")
    await tab.page.wait_for_url("**/console/sessions/con-a")
    await playwright.expect(tab.page.locator("[data-live-for=timeline]")).to_contain_text("Live")
    await tab.page.evaluate("window.__sameDocument = true")
    marker = "console-live-" + uuid.uuid4().hex[:8]
    agent = Agent(url, key, "con-a", **{"X-Org-Id": "acme", "X-User-Id": "ann"})
    ok, _ = await agent.call("shell", command=f"echo {marker}")
    assert ok
    timeline = tab.page.locator("#timeline tbody")
    await playwright.expect(timeline).to_contain_text(f"shell: echo {marker} -> exit 0")
    await playwright.expect(timeline).to_contain_text("sandbox.claimed")  # a sandbox that joined live
    ok, _ = await agent.call(
        "str_replace_based_edit_tool", command="create", path=f"/workspace/{marker}.txt", file_text="x\n"
    )
    assert ok
    await playwright.expect(timeline.locator("tr", has_text=f"/workspace/{marker}.txt")).to_contain_text(
        "edit"
    )
    # A request through the proxy, refused: the agent reads why; the timeline shows it.
    ok, out = await agent.call("shell", command="curl -sS --max-time 10 http://169.254.169.254/latest/")
    assert ok and "reason: metadata_address" in str(out), out
    await playwright.expect(timeline).to_contain_text("169.254.169.254:80 refused (metadata_address)")
    assert await tab.page.evaluate("window.__sameDocument") is True  # no reload happened
    await shot(tab, shots, "session-live", capsys)

    # Its sandbox, on the sandboxes page, filtered by the session's user.
    await tab.page.click("nav a[href='/console/sandboxes']")
    await tab.page.fill("#f-user", "ann")
    await tab.page.press("#f-user", "Enter")
    await tab.page.wait_for_url("**/console/sandboxes?*user=ann*")
    sandboxes = tab.page.locator("#sandboxes tbody")
    await playwright.expect(sandboxes.locator("tr")).to_have_count(1)
    await playwright.expect(sandboxes).to_contain_text("con-a")
    await shot(tab, shots, "sandboxes", capsys)
    await tab.page.click("#sandboxes a[href='/console/sessions/con-a']")
    await tab.page.wait_for_url("**/console/sessions/con-a")

    # A snapshot of it: on the session's page and on the snapshots page.
    taken = rest.post("/v1/sessions/con-a/snapshots", json={"snapshot_id": "con-a-snap"})
    assert taken.status_code == 201, taken.text
    await tab.page.reload()
    await playwright.expect(tab.page.locator("#session-snapshots tbody")).to_contain_text("con-a-snap")
    await tab.page.click("nav a[href='/console/snapshots']")
    await tab.page.wait_for_url("**/console/snapshots")
    snapshots = tab.page.locator("#snapshots tbody")
    await playwright.expect(snapshots.locator("tr", has_text="con-a-snap")).to_contain_text("acme")
    await shot(tab, shots, "snapshots", capsys)
    await tab.page.click("#snapshots a[href='/console/sessions/con-a']")
    await tab.page.wait_for_url("**/console/sessions/con-a")

    # Stop it from the page (keyboard again): the event carries who did it.
    await tab.page.focus("#stop")
    await tab.page.keyboard.press("Enter")
    await playwright.expect(tab.page.locator(".message.ok")).to_contain_text("Session stopped.")
    await playwright.expect(tab.page.locator("#timeline tbody")).to_contain_text("session.stopped")
    await playwright.expect(tab.page.locator("#stop")).to_be_disabled()
    entries = rest.get("/v1/sessions/con-a/timeline").json()["entries"]
    (stopped,) = [e for e in entries if e["type"] == "session.stopped"]
    assert stopped["user_id"] == OPERATOR_NAME and stopped["request_id"].startswith("console:")
    assert rest.get("/v1/sessions/con-a").json()["status"] == "stopped"
    assert tab.problems == [], tab.problems


async def test_forms_without_their_csrf_token_are_refused(tab, stack, rest):
    _, key = stack
    created = rest.post("/v1/sessions", json={"session_id": "con-csrf"})
    assert created.status_code == 201
    await tab.login(key)
    response = await tab.goto("/console/sessions/con-csrf")
    assert response.status == 200
    token = await tab.page.locator("input[name=csrf]").first.get_attribute("value")
    # The browser's own cookie goes with these requests: only the token is missing or wrong.
    for form in ({}, {"csrf": ""}, {"csrf": token[:-2] + "xx"}):
        refused = await tab.context.request.post(
            tab.base + "/console/sessions/con-csrf/stop", form=form, max_redirects=0
        )
        assert refused.status == 403, form
    deleting = await tab.context.request.post(
        tab.base + "/console/sessions/con-csrf/delete", form={"confirm": "yes"}, max_redirects=0
    )
    assert deleting.status == 403
    # A GET does nothing.
    assert (await tab.context.request.get(tab.base + "/console/sessions/con-csrf/stop")).status == 405
    assert rest.get("/v1/sessions/con-csrf").json()["status"] == "active"
    # Logged out, the token is worth nothing either.
    await tab.page.click("nav button[type=submit]")
    await tab.page.wait_for_url("**/console/login")
    after = await tab.context.request.post(
        tab.base + "/console/sessions/con-csrf/stop", form={"csrf": token}, max_redirects=0
    )
    assert after.status == 401
    assert rest.get("/v1/sessions/con-csrf").json()["status"] == "active"


async def test_delete_from_the_page_asks_for_confirmation_and_records_who(tab, stack, rest):
    _, key = stack
    assert rest.post("/v1/sessions", json={"session_id": "con-del", "org_id": "acme"}).status_code == 201
    await tab.login(key)
    await tab.goto("/console/sessions/con-del")
    await tab.page.click("#delete")  # not confirmed: the browser does not send the form
    assert tab.page.url.endswith("/console/sessions/con-del")
    assert rest.get("/v1/sessions/con-del").status_code == 200
    await tab.page.focus("#confirm-delete")
    await tab.page.keyboard.press("Space")
    await tab.page.focus("#delete")
    await tab.page.keyboard.press("Enter")
    await tab.page.wait_for_url("**/console/sessions?done=deleted")
    await playwright.expect(tab.page.locator(".message.ok")).to_contain_text("Session deleted.")
    assert rest.get("/v1/sessions/con-del").status_code == 404
    entries = rest.get("/v1/sessions/con-del/timeline").json()["entries"]
    (deleted,) = [e for e in entries if e["type"] == "session.deleted"]
    assert deleted["user_id"] == OPERATOR_NAME and deleted["request_id"].startswith("console:")
    # Deleted sessions are listed when asked for; their pages keep the timeline, not the buttons.
    await tab.goto("/console/sessions?status=deleted")
    await tab.page.click("a[href='/console/sessions/con-del']")
    await playwright.expect(tab.page.locator("#timeline tbody")).to_contain_text("session.deleted")
    assert await tab.page.locator("#stop, #delete").count() == 0
    assert tab.problems == [], tab.problems


async def test_every_page_is_locked_down_and_html_stays_text(tab, stack, rest, shots, capsys):
    _, key = stack
    created = rest.post("/v1/sessions", json={"session_id": "con-html", "org_id": "acme", "user_id": HOSTILE})
    assert created.status_code == 201
    ran = rest.post("/v1/sessions/con-html/run", json={"command": "echo '<b id=\"pwned\">bold</b>'"})
    assert ran.status_code == 200
    await tab.login(key)
    pages = ("/console/sessions", "/console/sessions/con-html", "/console/snapshots", "/console/audit")
    for path in (*pages, "/console/system"):
        response = await tab.goto(path)
        assert response.status == 200, path
        headers = await response.all_headers()
        csp = headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
        assert key not in await tab.page.content()
        assert await tab.page.locator("#pwned").count() == 0, path
        assert await tab.page.evaluate("window.__xss") is None, path

    # Live rows are text too.
    await tab.goto("/console/sessions/con-html")
    await playwright.expect(tab.page.locator("#timeline tbody")).to_contain_text('<b id="pwned">bold</b>')
    await playwright.expect(tab.page.locator("[data-live-for=timeline]")).to_contain_text("Live")
    ran = rest.post("/v1/sessions/con-html/run", json={"command": f"echo '{HOSTILE}'"})
    assert ran.status_code == 200
    await playwright.expect(tab.page.locator("#timeline tbody")).to_contain_text(HOSTILE)
    assert await tab.page.locator("#timeline img").count() == 0
    # Credentials in a URL are not shown (the audit record keeps what ran).
    assert (
        rest.post(
            "/v1/sessions/con-html/run", json={"command": "true https://ann:hunter2@example.com/"}
        ).status_code
        == 200
    )
    await playwright.expect(tab.page.locator("#timeline tbody")).to_contain_text("https://…@example.com/")
    assert "hunter2" not in await tab.page.content()
    assert await tab.page.evaluate("window.__xss") is None
    # An inline script injected into the page is refused by the policy.
    await tab.page.evaluate(
        "() => { const s = document.createElement('script'); s.textContent = 'window.__inline = 1';"
        " document.body.appendChild(s); }"
    )
    assert await tab.page.evaluate("window.__inline") is None
    tab.problems[:] = [p for p in tab.problems if "Content Security Policy" not in p]  # (that refusal)

    # The audit stream, live, and the system page with replay --verify.
    await tab.goto("/console/audit")
    await playwright.expect(tab.page.locator("[data-live-for=audit]")).to_contain_text("Live")
    marker = "audit-live-" + uuid.uuid4().hex[:8]
    assert rest.post("/v1/sessions/con-html/run", json={"command": f"echo {marker}"}).status_code == 200
    await playwright.expect(tab.page.locator("#audit tbody")).to_contain_text(marker)
    await shot(tab, shots, "audit-live", capsys)
    await tab.goto("/console/system")
    await playwright.expect(tab.page.locator("#instances")).to_contain_text("gateway")
    await playwright.expect(tab.page.locator("#pool")).to_contain_text("idle")
    await playwright.expect(tab.page.locator("#proxies")).to_contain_text("proxies: running")
    await tab.page.focus("#verify")
    await tab.page.keyboard.press("Enter")
    await playwright.expect(tab.page.locator("#replay-result")).to_contain_text(
        "projections match the event stream"
    )
    await shot(tab, shots, "system-replay", capsys)
    assert tab.problems == [], tab.problems


async def test_an_organisation_bound_key_sees_only_its_organisation(tab, stack, rest, shots, capsys):
    for sid, org in (("org-a", "acme"), ("org-g", "globex")):
        assert rest.post("/v1/sessions", json={"session_id": sid, "org_id": org}).status_code == 201
    await tab.login(ACME_KEY, "ann")
    table = tab.page.locator("#sessions tbody")
    await playwright.expect(table).to_contain_text("org-a")
    await playwright.expect(table).not_to_contain_text("org-g")
    assert rest.post("/v1/sessions/org-g/run", json={"command": "true"}).status_code == 200
    taken = rest.post("/v1/sessions/org-g/snapshots", json={"snapshot_id": "org-g-snap"})
    assert taken.status_code == 201, taken.text
    await tab.goto("/console/snapshots")  # globex's snapshot is not acme's
    assert "org-g-snap" not in await tab.page.locator("#snapshots").inner_text()
    assert (await tab.goto("/console/snapshots?org=globex")).status == 403
    await tab.goto("/console/sandboxes")  # globex's sandbox and the idle pool are not acme's
    listed = tab.page.locator("#sandboxes tbody tr")
    assert await listed.count() > 0
    for text in await listed.all_inner_texts():
        assert "acme" in text and "org-g" not in text and "globex" not in text, text
    assert await tab.page.locator("#f-org").get_attribute("readonly") is not None
    assert await tab.page.locator("#f-org").input_value() == "acme"
    assert (await tab.goto("/console/sessions?org=globex")).status == 403
    assert (await tab.goto("/console/sessions/org-g")).status == 404
    assert (await tab.goto("/console/system")).status == 403
    assert await tab.page.locator("nav a[href='/console/system']").count() == 0
    stop = await tab.context.request.post(tab.base + "/console/sessions/org-g/stop", form={}, max_redirects=0)
    assert stop.status == 403  # (no token; with one it is 404, as another organisation's session)

    # The audit stream: globex's command first, then acme's; when acme's shows, globex's
    # (earlier in the stream) would have shown before it, had it been visible.
    await tab.goto("/console/audit")
    await playwright.expect(tab.page.locator("[data-live-for=audit]")).to_contain_text("Live")
    theirs, ours = ("globex-" + uuid.uuid4().hex[:8]), ("acme-" + uuid.uuid4().hex[:8])
    assert rest.post("/v1/sessions/org-g/run", json={"command": f"echo {theirs}"}).status_code == 200

    def recorded() -> bool:
        listed = rest.get("/v1/sessions/org-g/timeline", params={"kind": "command"}).json()["entries"]
        return any(theirs in e["command"] for e in listed)

    await support.eventually(recorded, timeout=30)  # it is in the stream
    assert rest.post("/v1/sessions/org-a/run", json={"command": f"echo {ours}"}).status_code == 200
    audit = tab.page.locator("#audit tbody")
    await playwright.expect(audit).to_contain_text(ours)
    await playwright.expect(audit).not_to_contain_text(theirs)
    await playwright.expect(audit).not_to_contain_text("org-g")
    await shot(tab, shots, "audit-acme", capsys)
    # The stream itself refuses another organisation's session.
    other = await tab.context.request.get(tab.base + "/console/sessions/org-g/timeline/stream")
    assert other.status == 404
    # Only the refusals asked for above.
    assert set(tab.problems) <= {REFUSED.format("403 (Forbidden)"), REFUSED.format("404 (Not Found)")}, (
        tab.problems
    )


SCRIPTED = "<script>window.__xss=2</script>\"'{{ 7*7 }}"
"""A name holding a script element, both quotes and template syntax."""


async def test_script_quotes_and_template_syntax_stay_text_on_every_page_and_live(tab, stack, rest):
    _, key = stack
    created = rest.post("/v1/sessions", json={"session_id": "con-tpl", "org_id": "acme", "user_id": SCRIPTED})
    assert created.status_code == 201, created.text
    command = ": \"<script>window.__xss=3</script>'{{ 7*7 }}'\""
    assert rest.post("/v1/sessions/con-tpl/run", json={"command": command + " first"}).status_code == 200
    await tab.login(key, name=SCRIPTED)  # the name shows on every page too

    async def inert(path: str) -> str:
        """The page's text, after checking that nothing of the hostile text became an element."""
        assert await tab.page.evaluate("document.scripts.length") == 1, path  # console.js alone
        assert await tab.page.locator("#pwned, main img, main [onerror]").count() == 0, path
        assert await tab.page.evaluate("window.__xss") is None, path
        text = await tab.page.locator("body").inner_text()
        assert SCRIPTED in text, path  # (its {{ 7*7 }} as written)
        return text

    for path in ("/console/sessions", "/console/sandboxes", "/console/sessions/con-tpl", "/console/audit"):
        assert (await tab.goto(path)).status == 200, path
        await inert(path)
    assert (await tab.goto("/console/sessions/con-tpl")).status == 200
    assert command + " first" in await inert("the session's timeline")
    # In an attribute: the filter's field holds it as written, and it filters.
    assert (await tab.goto("/console/sessions?" + urllib.parse.urlencode({"user": SCRIPTED}))).status == 200
    assert await tab.page.locator("#f-user").input_value() == SCRIPTED
    await playwright.expect(tab.page.locator("#sessions tbody tr")).to_have_count(1)
    await inert("filtered")

    # Live: a row added while the page is open is text too, on the timeline and the audit stream.
    for path, table in (("/console/sessions/con-tpl", "#timeline tbody"), ("/console/audit", "#audit tbody")):
        await tab.goto(path)
        await playwright.expect(tab.page.locator("[data-live-for]")).to_contain_text("Live")
        marker = "live-" + uuid.uuid4().hex[:8]
        ran = rest.post("/v1/sessions/con-tpl/run", json={"command": f"{command} {marker}"})
        assert ran.status_code == 200
        await playwright.expect(tab.page.locator(table)).to_contain_text(f"{command} {marker}")
        assert await tab.page.locator(f"{table} tr.fresh script").count() == 0
        await inert(path + " (live)")
    assert tab.problems == [], tab.problems
