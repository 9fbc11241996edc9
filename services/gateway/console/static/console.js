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

const CELLS = {
  // A timeline entry (the API's TimelineEntry): as views.timeline_row renders one.
  entry: (e) => [String(e.seq), when(e.time), e.kind, e.summary, who(e.org_id, e.user_id)],
  // An audit record (views.AuditRecord), already in text.
  record: (r) => [String(r.seq), r.time, r.type, { link: r.session }, r.summary, r.who, r.by],
};

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
    td.textContent = value == null ? "" : String(value);
  }
  return td;
}

function live(table) {
  const kind = table.dataset.event;
  const status = document.querySelector('[data-live-for="' + table.id + '"]');
  const body = table.tBodies[0];
  const seen = new Set(Array.from(body.rows, (row) => row.cells[0].textContent));
  const say = (text) => { if (status) status.textContent = text; };
  const source = new EventSource(table.dataset.stream);
  source.addEventListener("open", () => say("Live: new entries appear as they happen."));
  source.addEventListener("error", () => say("Disconnected: reconnecting…"));
  source.addEventListener(kind, (message) => {
    const item = JSON.parse(message.data);
    const key = String(item.seq);
    if (seen.has(key)) return;
    seen.add(key);
    const row = document.createElement("tr");
    CELLS[kind](item).forEach((value, i) => {
      const td = cell(value);
      if (i === 3 && kind === "entry") td.className = "summary";
      row.appendChild(td);
    });
    row.className = "fresh";
    body.appendChild(row);
  });
  window.addEventListener("pagehide", () => source.close());
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("table[data-stream]").forEach(live);
});
