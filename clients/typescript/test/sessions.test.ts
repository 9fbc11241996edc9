import assert from "node:assert/strict";
import { test } from "node:test";
import { SandboxApiError } from "@cloud-agent-sandbox/client";
import { client, sessionId } from "./support.js";

test("create, get, list, stop, delete", async () => {
  const orgId = `org-${sessionId("o")}`;
  const sandbox = client({ orgId, userId: "ts-user" });
  const id = sessionId("life");
  const created = await sandbox.sessions.create({ session_id: id }, { idempotencyKey: `create-${id}` });
  assert.equal(created.session_id, id);
  assert.equal(created.status, "active");
  assert.equal(created.org_id, orgId); // (X-Org-Id and X-User-Id, from the client's options)
  assert.equal(created.user_id, "ts-user");
  assert.equal(created.incarnation, 1);

  assert.deepEqual(await sandbox.sessions.get(id), created);

  const mine = await sandbox.sessions.list({ org_id: orgId, status: "active" });
  assert.equal(mine.count, 1);
  assert.deepEqual(mine.sessions.map((s) => s.session_id), [id]);
  const limited = await sandbox.sessions.list({ limit: 1 });
  assert.ok(limited.sessions.length <= 1 && limited.count >= 1);

  const stopped = await sandbox.sessions.stop(id);
  assert.equal(stopped.status, "stopped");
  assert.equal((await sandbox.sessions.stop(id)).status, "stopped"); // idempotent

  await sandbox.sessions.delete(id, { idempotencyKey: `delete-${id}` });
  await sandbox.sessions.delete(id, { idempotencyKey: `delete-${id}` }); // a retry: no second transition
  const gone = await sandbox.sessions.get(id).catch((error: unknown) => error);
  assert.ok(gone instanceof SandboxApiError);
  assert.equal(gone.status, 404);
  assert.equal(gone.code, "not_found");
  const deleted = await sandbox.sessions.list({ org_id: orgId, status: "deleted" });
  assert.deepEqual(deleted.sessions.map((s) => [s.session_id, s.status]), [[id, "deleted"]]);
});

test("a session id that exists is a conflict", async () => {
  const sandbox = client();
  const id = sessionId("twice");
  await sandbox.sessions.create({ session_id: id });
  await assert.rejects(sandbox.sessions.create({ session_id: id }), (error: unknown) => {
    assert.ok(error instanceof SandboxApiError);
    assert.equal(error.status, 409);
    assert.equal(error.code, "conflict");
    return true;
  });
  await sandbox.sessions.delete(id);
});

test("bad input is a 400 with the server's code and message", async () => {
  const sandbox = client();
  await assert.rejects(sandbox.sessions.create({ session_id: "no spaces allowed" }), (error: unknown) => {
    assert.ok(error instanceof SandboxApiError);
    assert.equal(error.status, 400);
    assert.equal(error.code, "invalid_input");
    assert.equal(error.retriable, false);
    assert.match(error.message, /session/);
    return true;
  });
  await assert.rejects(sandbox.sessions.list({ limit: 0 }), { name: "SandboxApiError", status: 400 });
});

test("a wrong key is a 401", async () => {
  await assert.rejects(client({ apiKey: "not-the-key-0123456789" }).sessions.list(), {
    name: "SandboxApiError",
    status: 401,
    code: "unauthorized",
  });
});
