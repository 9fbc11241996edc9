import assert from "node:assert/strict";
import { test } from "node:test";
import { SandboxApiError, tar, untar } from "@cloud-agent-sandbox/client";
import { client, sessionId } from "./support.js";

const sandbox = client();
const bytes = (text: string) => new TextEncoder().encode(text);
const allBytes = Uint8Array.from({ length: 256 * 3 + 7 }, (_, i) => (i * 7) % 256);

test("upload a tar, then download it back", async () => {
  const id = sessionId("archive");
  const archive = tar([
    { name: "src/main.py", data: bytes("print('hi')\n"), mode: 0o755 },
    { name: "README.md", data: bytes("# demo\n") },
  ]);
  const written = await sandbox.uploadArchive(id, archive, { root: "/workspace/proj" });
  assert.ok(written.sandbox_id);
  assert.equal(typeof written.duration, "number");

  const ran = await sandbox.run(id, { command: "python3 src/main.py || cat src/main.py; stat -c %a src/main.py", cwd: "/workspace/proj" });
  assert.match(ran.stdout, /755\n$/);

  const stream = await sandbox.downloadArchive(id, { root: "/workspace/proj", paths: ["src/main.py", "README.md"] });
  const back = untar(new Uint8Array(await new Response(stream).arrayBuffer()));
  assert.deepEqual(
    back.map((f) => [f.name, new TextDecoder().decode(f.data), f.mode]),
    [
      ["src/main.py", "print('hi')\n", 0o755],
      ["README.md", "# demo\n", 0o644],
    ],
  );

  // A stream as the body works too (Node's fetch sends it chunked).
  const streamed = new Blob([archive as Uint8Array<ArrayBuffer>]).stream();
  assert.ok((await sandbox.uploadArchive(id, streamed, { root: "/workspace/again" })).sandbox_id);
  assert.deepEqual(await sandbox.readFile(id, "/workspace/again/README.md"), bytes("# demo\n"));
  await sandbox.sessions.delete(id);
});

test("writeFile and readFile: non-ASCII names, binary content, relative and absolute paths", async () => {
  const id = sessionId("files");
  const names = ["/workspace/données/naïve ☃.bin", "deep/ünïcödé/" + "long-".repeat(30) + "名前.bin"];
  for (const name of names) await sandbox.writeFile(id, name, allBytes);
  for (const name of names) assert.deepEqual(await sandbox.readFile(id, name), allBytes);
  await sandbox.writeFile(id, "/workspace/text.txt", "héllo\n");
  const listed = await sandbox.run(id, { command: "ls /workspace/données; cat /workspace/text.txt; find /workspace/deep -type f | wc -l" });
  assert.equal(listed.stdout, "naïve ☃.bin\nhéllo\n1\n");
  await sandbox.writeFile(id, "/workspace/empty", new Uint8Array(0));
  assert.deepEqual(await sandbox.readFile(id, "/workspace/empty"), new Uint8Array(0));
  await sandbox.sessions.delete(id);
});

test("reading what is not a file is a clear error", async () => {
  const id = sessionId("notfile");
  await sandbox.writeFile(id, "dir/inside.txt", "x");
  await assert.rejects(sandbox.readFile(id, "/workspace/dir"), /"dir\/?" is a directory: only regular files are read/);
  await assert.rejects(sandbox.readFile(id, "/workspace/missing.txt"), (error: unknown) => {
    assert.ok(error instanceof SandboxApiError);
    assert.deepEqual([error.status, error.code], [404, "not_found"]);
    return true;
  });
  await assert.rejects(sandbox.readFile(id, "/etc/passwd"), { name: "SandboxApiError", status: 400 });
  await sandbox.sessions.delete(id);
});

test("a download never starts a sandbox: 404 for a session without one", async () => {
  await assert.rejects(sandbox.downloadArchive(sessionId("nosandbox")), {
    name: "SandboxApiError",
    status: 404,
    code: "not_found",
  });
});

test("an upload that is not a tar is a 400", async () => {
  const id = sessionId("nottar");
  await assert.rejects(sandbox.uploadArchive(id, bytes("not a tar at all")), {
    name: "SandboxApiError",
    status: 400,
  });
  await sandbox.sessions.delete(id).catch(() => undefined);
});
