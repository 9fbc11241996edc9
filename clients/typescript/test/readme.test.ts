// The README's usage example, run as it is written; its output is what the README says.
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdir, readFile, writeFile } from "node:fs/promises";
import { test } from "node:test";
import { promisify } from "node:util";
import { settings } from "./support.js";

const PACKAGE = new URL("../../", import.meta.url); // (from build/test/)

function block(readme: string, after: string): string {
  const found = readme.split(after)[1]?.match(/```\w*\n([\s\S]*?)\n```/);
  assert.ok(found?.[1], `no code block after ${after} in README.md`);
  return found[1];
}

test("the README example runs and prints what the README says", async () => {
  const readme = await readFile(new URL("README.md", PACKAGE), "utf8");
  // Inside the package, so that its import of the package by name resolves to this build.
  const script = new URL("build/readme/example.mjs", PACKAGE);
  await mkdir(new URL(".", script), { recursive: true });
  await writeFile(script, block(readme, "<!-- test: example -->"));
  const { stdout } = await promisify(execFile)(process.execPath, [script.pathname], {
    env: { ...process.env, ...settings() },
  });
  assert.equal(stdout.trimEnd(), block(readme, "\nprints "));
});
