// The ustar writer and reader, without a server.
import assert from "node:assert/strict";
import { test } from "node:test";
import { tar, untar } from "@cloud-agent-sandbox/client";

const data = Uint8Array.from({ length: 1500 }, (_, i) => i % 251);

test("what tar writes, untar reads: short, prefixed, pax-long and non-ASCII names", () => {
  const names = ["a.txt", `${"d/".repeat(60)}file`, `${"x".repeat(150)}/名前`, "ünï/çödé ☃"];
  const files = names.map((name, i) => ({ name, data: data.subarray(i), mode: 0o600 + i, mtime: 1_700_000_000 + i }));
  const archive = tar(files);
  assert.equal(archive.length % 512, 0);
  assert.deepEqual(untar(archive).map((f) => ({ ...f, data: [...f.data] })), files.map((f) => ({ ...f, data: [...f.data] })));
});

test("the writer refuses what is not a file name", () => {
  assert.throws(() => tar([{ name: "", data }]), /not a file name/);
  assert.throws(() => tar([{ name: "dir/", data }]), /not a file name/);
});

test("the reader names an entry that is not a regular file, and refuses what is not a tar", () => {
  const archive = tar([{ name: "link", data: new Uint8Array(0) }]);
  archive[156] = "2".charCodeAt(0); // make it a symbolic link, with a right checksum
  archive.fill(0x20, 148, 156);
  const sum = archive.subarray(0, 512).reduce((total, byte) => total + byte, 0);
  archive.set(new TextEncoder().encode(`${sum.toString(8).padStart(6, "0")}\0 `), 148);
  assert.throws(() => untar(archive), /"link" is a symbolic link: only regular files are read/);
  assert.throws(() => untar(new Uint8Array(1024).fill(1)), /not a tar/);
});
