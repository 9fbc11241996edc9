import assert from "node:assert/strict";
import { test } from "node:test";
import { SandboxApiError, type RunEvent } from "@cloud-agent-sandbox/client";
import { client, eventually, sessionId } from "./support.js";

const sandbox = client();

/** Whether a process whose command line has `marker` still runs in the session's sandbox. */
async function running(session: string, marker: string): Promise<boolean> {
  // ([x] keeps pgrep from finding its own shell, whose command line holds the pattern)
  const found = await sandbox.run(session, { command: `pgrep -f '${marker.replace(/^./, "[$&]")}'` });
  return found.exitCode === 0;
}

test("stdout and stderr stream in order, then the exit", async () => {
  const id = sessionId("order");
  const run = await sandbox.stream(id, {
    command: "echo out1; sleep 0.1; echo err1 >&2; sleep 0.1; echo out2; sleep 0.1; printf 'err2 é' >&2; exit 3",
  });
  assert.match(run.runId, /^[0-9a-f]{32}$/);
  assert.ok(run.sandboxId);
  const events: RunEvent[] = [];
  for await (const event of run) events.push(event);
  const output = events.filter((e) => e.type === "stdout" || e.type === "stderr");
  assert.deepEqual(output, [
    { type: "stdout", data: "out1\n" },
    { type: "stderr", data: "err1\n" },
    { type: "stdout", data: "out2\n" },
    { type: "stderr", data: "err2 é" },
  ]);
  const last = events.at(-1);
  assert.ok(last?.type === "exit");
  assert.equal(last.exit_code, 3);
  assert.equal(last.timed_out, false);
  assert.equal(last.sandbox_id, run.sandboxId);
  await sandbox.sessions.delete(id);
});

test("output arrives while the command still runs", async () => {
  const id = sessionId("live");
  // The command waits for a file that is made only after its first line was read here.
  const run = await sandbox.stream(id, {
    command: "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second",
    timeout: 60,
  });
  const events = run[Symbol.asyncIterator]();
  assert.deepEqual((await events.next()).value, { type: "stdout", data: "first\n" });
  assert.equal((await sandbox.run(id, { command: "touch /tmp/go" })).exitCode, 0);
  assert.deepEqual((await events.next()).value, { type: "stdout", data: "second\n" });
  const last = (await events.next()).value as RunEvent;
  assert.ok(last.type === "exit" && last.exit_code === 0);
  await sandbox.sessions.delete(id);
});

test("run collects stdout, stderr and the exit code; a non-zero exit is a result", async () => {
  const id = sessionId("collect");
  const ok = await sandbox.run(id, { command: "echo hi; echo there >&2", env: { GREETING: "x" } });
  assert.deepEqual([ok.stdout, ok.stderr, ok.exitCode, ok.timedOut], ["hi\n", "there\n", 0, false]);
  const failed = await sandbox.run(id, { command: "echo $GREETING; exit 42", env: { GREETING: "hello" } });
  assert.deepEqual([failed.stdout, failed.exitCode], ["hello\n", 42]);
  const where = await sandbox.run(id, { command: "pwd", cwd: "/tmp" });
  assert.equal(where.stdout, "/tmp\n");
  await sandbox.sessions.delete(id);
});

test("with list_root, the tree's listing comes before the exit (base64 in listing events)", async () => {
  const id = sessionId("listing");
  const events: RunEvent[] = [];
  for await (const event of await sandbox.stream(id, { command: "mkdir -p t/sub && touch t/sub/f.txt", list_root: "/workspace/t" })) {
    events.push(event);
  }
  const listing = events.filter((e) => e.type === "listing");
  assert.ok(listing.length > 0);
  assert.equal(events.at(-1)?.type, "exit");
  // (records: "type mode size mtime ctime inode path", NUL, link target, NUL)
  const fields = Buffer.concat(listing.map((e) => Buffer.from(e.data, "base64"))).toString().split("\0");
  const heads = fields.filter((_, i) => i % 2 === 0 && i < fields.length - 1);
  assert.deepEqual(heads.map((h) => `${h[0]} ${h.split(" ").at(-1)}`).sort(), ["d sub", "f sub/f.txt"]);
  await sandbox.sessions.delete(id);
});

test("a command that outlives its timeout is killed: timedOut, no exit code", async () => {
  const id = sessionId("timeout");
  const result = await sandbox.run(id, { command: "echo before; sleep 4711", timeout: 1 });
  assert.equal(result.stdout, "before\n");
  assert.equal(result.timedOut, true);
  assert.equal(result.exitCode, null);
  await eventually("the timed-out command is gone", async () => !(await running(id, "sleep 4711")));
  await sandbox.sessions.delete(id);
});

test("aborting the signal stops the command", async () => {
  const id = sessionId("abort");
  const controller = new AbortController();
  const run = await sandbox.stream(id, { command: "echo started; sleep 4712" }, { signal: controller.signal });
  await assert.rejects(
    (async () => {
      for await (const event of run) {
        if (event.type !== "stdout") continue;
        await eventually("it runs", () => running(id, "sleep 4712")); // (so its absence below means something)
        controller.abort();
      }
    })(),
    { name: "AbortError" },
  );
  await eventually("the aborted command is killed", async () => !(await running(id, "sleep 4712")));
  await sandbox.sessions.delete(id);
});

test("leaving the loop early stops the command too", async () => {
  const id = sessionId("break");
  const run = await sandbox.stream(id, { command: "echo started; sleep 4713" });
  for await (const event of run) {
    if (event.type !== "stdout") continue;
    await eventually("it runs", () => running(id, "sleep 4713"));
    break;
  }
  await eventually("the abandoned command is killed", async () => !(await running(id, "sleep 4713")));
  await sandbox.sessions.delete(id);
});

test("stop() kills the command and its exit still comes", async () => {
  const id = sessionId("stop");
  const run = await sandbox.stream(id, { command: "echo started; sleep 4714; echo never" });
  const events: RunEvent[] = [];
  for await (const event of run) {
    events.push(event);
    if (event.type !== "stdout") continue;
    await eventually("it runs", () => running(id, "sleep 4714"));
    await run.stop();
  }
  assert.deepEqual(events.filter((e) => e.type === "stdout").map((e) => e.data), ["started\n"]);
  assert.equal(events.at(-1)?.type, "exit");
  await eventually("the stopped command is gone", async () => !(await running(id, "sleep 4714")));
  await sandbox.sessions.delete(id);
});

test("bad run input is refused before anything runs", async () => {
  const id = sessionId("bad");
  await assert.rejects(sandbox.run(id, { command: "true", timeout: -1 }), (error: unknown) => {
    assert.ok(error instanceof SandboxApiError);
    assert.deepEqual([error.status, error.code], [400, "invalid_input"]);
    return true;
  });
  // (input is checked before a sandbox is claimed: the session was not created)
  await assert.rejects(sandbox.sessions.get(id), { name: "SandboxApiError", code: "not_found" });
});
