// The console's live tables: a table with data-stream gets new rows from server-sent
// events (a session's timeline, the audit stream). Rows are built with textContent only:
// nothing received is ever parsed as HTML. No inline script: the CSP forbids it.
"use strict";

function when(iso) {
  // As the server renders times: seconds, UTC.
  const t = new Date(iso);
  return isNaN(t) ? String(iso) : t.toISOString().slice(0, 19) + "Z";
}

function who(org, user) {
  return [org, user].filter(Boolean).join(" / ");
}

function redact(text) {
  // As views.redact: the user and password of a URL in a command are not shown.
  return String(text).replace(/\b([a-z][a-z0-9+.-]*:\/\/)[^\/@\s]*@/gi, "$1…@");
}

const CELLS = {
  // A timeline entry (the API's TimelineEntry): as views.timeline_row renders one.
  entry: (e) => [
    String(e.seq), when(e.time), e.kind, redact(e.summary), who(e.org_id, e.user_id),
    e.incarnation == null ? "" : String(e.incarnation),
  ],
  // An audit record (views.AuditRecord), already in text.
  record: (r) => [String(r.seq), r.time, r.type, { link: r.session }, r.summary, r.who, r.by],
};

// Characters that reorder the text around them (U+202E reverses what follows) are shown
// as escapes, as the server's templates show them.
const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;
const shown = (text) => text.replace(BIDI, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));

function cell(value) {
  const td = document.createElement("td");
  if (value && typeof value === "object") {
    if (value.link) {
      const a = document.createElement("a");
      a.href = "/console/sessions/" + encodeURIComponent(value.link);
      a.textContent = value.link;
      td.appendChild(a);
    }
  } else {
    td.textContent = value == null ? "" : shown(String(value));
  }
  return td;
}

function live(table) {
  const kind = table.dataset.event;
  const status = document.querySelector('[data-live-for="' + table.id + '"]');
  const body = table.tBodies[0];
  const seen = new Set(Array.from(body.rows, (row) => row.cells[0].textContent));
  const say = (text) => { if (status) status.textContent = text; };
  const url = new URL(table.dataset.stream, window.location.href);
  let last = Number(url.searchParams.get("after") || 0);
  let source = null;
  let wait = 2000;

  function add(message) {
    const item = JSON.parse(message.data);
    last = Math.max(last, item.seq);
    const key = String(item.seq);
    if (seen.has(key)) return;
    seen.add(key);
    const row = document.createElement("tr");
    CELLS[kind](item).forEach((value, i) => {
      const td = cell(value);
      if ((kind === "entry" && i === 3) || (kind === "record" && i === 4)) td.className = "summary";
      row.appendChild(td);
    });
    row.className = "fresh";
    body.appendChild(row);
  }

  function connect() {
    url.searchParams.set("after", String(last));
    source = new EventSource(url.pathname + url.search);
    source.addEventListener("open", () => { wait = 2000; say("Live: new entries appear as they happen."); });
    source.addEventListener(kind, add);
    source.addEventListener("error", () => {
      // The browser reconnects by itself after a dropped stream; an answer that is not a
      // stream (503: too many streams; 401: logged out) closes it for good: try again later.
      if (source.readyState === EventSource.CLOSED) {
        say("Disconnected: trying again in " + Math.round(wait / 1000) + " s…");
        setTimeout(connect, wait);
        wait = Math.min(wait * 2, 60000);
      } else {
        say("Disconnected: reconnecting…");
      }
    });
  }

  connect();
  window.addEventListener("pagehide", () => source && source.close());
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("table[data-stream]").forEach(live);
});
