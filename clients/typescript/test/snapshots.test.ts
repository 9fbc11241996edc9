import assert from "node:assert/strict";
import { test } from "node:test";
import { SandboxApiError } from "@cloud-agent-sandbox/client";
import { client, sessionId } from "./support.js";

test("take a snapshot, fork it, restore to it, delete it", async () => {
  const sandbox = client();
  const origin = sessionId("snap");
  const ran = await sandbox.run(origin, { command: "echo one > /workspace/f" });
  assert.equal(ran.exitCode, 0);

  const snapshot = await sandbox.snapshots.take(origin, { idempotencyKey: `take-${origin}` });
  assert.equal(snapshot.session_id, origin);
  assert.equal(snapshot.status, "ready");
  assert.match(snapshot.digest, /^sha256:/);
  assert.deepEqual(await sandbox.snapshots.take(origin, { idempotencyKey: `take-${origin}` }), snapshot);
  assert.deepEqual(await sandbox.snapshots.get(snapshot.snapshot_id), snapshot);
  const listed = await sandbox.snapshots.list({ session_id: origin });
  assert.deepEqual(listed.snapshots.map((s) => s.snapshot_id), [snapshot.snapshot_id]);

  const kept = await sandbox.snapshots.warm(snapshot.snapshot_id, 1);
  assert.equal(kept.warm, 1);
  const forks = await sandbox.snapshots.fork(snapshot.snapshot_id, { count: 2 });
  assert.equal(forks.sessions.length, 2);
  assert.deepEqual(forks.failed, []);
  for (const fork of forks.sessions) {
    assert.equal(fork.forked_from, snapshot.snapshot_id);
    const read = await sandbox.run(fork.session_id, { command: "cat /workspace/f" });
    assert.equal(read.stdout, "one\n");
  }

  await sandbox.run(origin, { command: "echo two > /workspace/f" });
  await sandbox.snapshots.restore(origin, snapshot.snapshot_id);
  assert.equal((await sandbox.run(origin, { command: "cat /workspace/f" })).stdout, "one\n");

  assert.equal((await sandbox.snapshots.warm(snapshot.snapshot_id, 0)).warm, 0);
  await sandbox.snapshots.delete(snapshot.snapshot_id);
  const gone = await sandbox.snapshots.get(snapshot.snapshot_id).catch((e: unknown) => e);
  assert.ok(gone instanceof SandboxApiError && gone.status === 404);
  const deleted = await sandbox.snapshots.list({ session_id: origin, status: "deleted" });
  assert.deepEqual(deleted.snapshots.map((s) => [s.snapshot_id, s.delete_reason]), [[snapshot.snapshot_id, "requested"]]);
  const refused = await sandbox.snapshots.fork(snapshot.snapshot_id, { count: 1 }).catch((e: unknown) => e);
  assert.ok(refused instanceof SandboxApiError);
  assert.equal(refused.status, 404);
  for (const id of [origin, ...forks.sessions.map((s) => s.session_id)]) await sandbox.sessions.delete(id);
});
