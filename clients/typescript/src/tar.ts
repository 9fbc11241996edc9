/**
 * A tiny tar writer and reader for regular files (what `writeFile` and `readFile` need).
 * The writer makes POSIX ustar, with a pax `path` record for names that do not fit; the
 * reader takes ustar, pax and GNU long names, and refuses, by name, any entry that is not
 * a regular file (a directory, a link, a device...).
 */

const BLOCK = 512;
const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** One regular file of an archive. */
export interface TarFile {
  /** Its path in the archive, relative (`dir/name.txt`). */
  name: string;
  data: Uint8Array;
  /** Permission bits (default 0o644). */
  mode?: number;
  /** Modification time, seconds since the epoch (default: now). */
  mtime?: number;
}

const KINDS: Record<string, string> = {
  "1": "hard link",
  "2": "symbolic link",
  "3": "character device",
  "4": "block device",
  "5": "directory",
  "6": "FIFO",
};

// ---- writing ----------------------------------------------------------------------------

/** A tar of these files. */
export function tar(files: Iterable<TarFile>): Uint8Array {
  const parts: Uint8Array[] = [];
  for (const file of files) {
    const name = encoder.encode(file.name);
    if (name.length === 0 || file.name.endsWith("/") || file.name.includes("\0")) {
      throw new Error(`not a file name for a tar: ${JSON.stringify(file.name)}`);
    }
    const mtime = Math.floor(file.mtime ?? Date.now() / 1000);
    const split = splitName(name);
    if (split === undefined) {
      const record = paxRecord("path", file.name);
      parts.push(header(encoder.encode("PaxHeader"), new Uint8Array(0), 0o644, record.length, mtime, "x"));
      parts.push(...padded(record));
    }
    const [prefix, base] = split ?? [new Uint8Array(0), name.slice(-100)];
    parts.push(header(base, prefix, file.mode ?? 0o644, file.data.length, mtime, "0"));
    parts.push(...padded(file.data));
  }
  parts.push(new Uint8Array(2 * BLOCK));
  return concat(parts);
}

/** ustar's name and prefix fields for a name, if it fits them. */
function splitName(name: Uint8Array): [Uint8Array, Uint8Array] | undefined {
  if (name.length <= 100) return [new Uint8Array(0), name];
  for (let i = name.length - 1; i > 0; i--) {
    if (name[i] === 0x2f && i <= 155 && name.length - i - 1 <= 100 && name.length - i - 1 > 0) {
      return [name.slice(0, i), name.slice(i + 1)];
    }
  }
  return undefined;
}

/** One pax record, `"<length> <key>=<value>\n"`, the length counting itself. */
function paxRecord(key: string, value: string): Uint8Array {
  const body = encoder.encode(` ${key}=${value}\n`);
  let length = body.length + 1;
  while (String(length).length + body.length > length) length++;
  return concat([encoder.encode(String(length)), body]);
}

function header(
  name: Uint8Array,
  prefix: Uint8Array,
  mode: number,
  size: number,
  mtime: number,
  type: string,
): Uint8Array {
  const block = new Uint8Array(BLOCK);
  block.set(name, 0);
  block.set(octal(mode & 0o7777, 8), 100);
  block.set(octal(0, 8), 108); // uid
  block.set(octal(0, 8), 116); // gid
  block.set(octal(size, 12), 124);
  block.set(octal(mtime, 12), 136);
  block.set(encoder.encode("        "), 148); // the checksum counts its own field as spaces
  block.set(encoder.encode(type), 156);
  block.set(encoder.encode("ustar\u000000"), 257);
  block.set(prefix, 345);
  const sum = block.reduce((total, byte) => total + byte, 0);
  block.set(encoder.encode(`${sum.toString(8).padStart(6, "0")}\u0000 `), 148);
  return block;
}

function octal(value: number, width: number): Uint8Array {
  const digits = value.toString(8);
  if (digits.length > width - 1) throw new Error(`${value} does not fit a tar header field`);
  return encoder.encode(`${digits.padStart(width - 1, "0")}\u0000`);
}

function padded(data: Uint8Array): Uint8Array[] {
  const rest = data.length % BLOCK;
  return rest === 0 ? [data] : [data, new Uint8Array(BLOCK - rest)];
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((total, part) => total + part.length, 0));
  let at = 0;
  for (const part of parts) {
    out.set(part, at);
    at += part.length;
  }
  return out;
}

// ---- reading ----------------------------------------------------------------------------

/** The regular files of a tar; any other kind of entry is an error that names it. */
export function untar(archive: Uint8Array): TarFile[] {
  const files: TarFile[] = [];
  let longName: string | undefined;
  let at = 0;
  while (at + BLOCK <= archive.length) {
    const block = archive.subarray(at, at + BLOCK);
    if (block.every((byte) => byte === 0)) break; // the end
    checkSum(block, at);
    const type = String.fromCharCode(block[156] ?? 0);
    const size = number(block.subarray(124, 136));
    const data = archive.subarray(at + BLOCK, at + BLOCK + size);
    if (data.length < size) throw new Error("not a whole tar: it ends inside an entry");
    at += BLOCK + Math.ceil(size / BLOCK) * BLOCK;
    const name = longName ?? headerName(block);
    longName = undefined;
    if (type === "x") {
      longName = paxPath(data);
    } else if (type === "L") {
      longName = text(data);
    } else if (type === "0" || type === "\0" || type === "7") {
      files.push({ name, data: data.slice(), mode: number(block.subarray(100, 108)), mtime: number(block.subarray(136, 148)) });
    } else if (type !== "g") {
      const kind = KINDS[type] ?? `entry of type ${JSON.stringify(type)}`;
      throw new Error(`${JSON.stringify(name)} is a ${kind}: only regular files are read`);
    }
  }
  return files;
}

function checkSum(block: Uint8Array, at: number): void {
  let sum = 0;
  for (let i = 0; i < BLOCK; i++) sum += i >= 148 && i < 156 ? 0x20 : (block[i] ?? 0);
  if (sum !== number(block.subarray(148, 156))) {
    throw new Error(`not a tar: the header at byte ${at} has a wrong checksum`);
  }
}

function headerName(block: Uint8Array): string {
  const name = text(block.subarray(0, 100));
  const magic = text(block.subarray(257, 262));
  const prefix = magic === "ustar" ? text(block.subarray(345, 500)) : "";
  return prefix ? `${prefix}/${name}` : name;
}

/** A header's number: octal text, or GNU's base-256 (high bit set) for big ones. */
function number(field: Uint8Array): number {
  if (((field[0] ?? 0) & 0x80) !== 0) {
    return field.subarray(1).reduce((total, byte) => total * 256 + byte, (field[0] ?? 0) & 0x7f);
  }
  const digits = text(field).trim();
  return digits ? Number.parseInt(digits, 8) : 0;
}

/** Text up to the first NUL. */
function text(bytes: Uint8Array): string {
  const end = bytes.indexOf(0);
  return decoder.decode(end < 0 ? bytes : bytes.subarray(0, end));
}

function paxPath(data: Uint8Array): string | undefined {
  let path: string | undefined;
  let at = 0;
  while (at < data.length) {
    const space = data.indexOf(0x20, at);
    const length = Number.parseInt(decoder.decode(data.subarray(at, space)), 10);
    if (space < 0 || !(length > 0)) throw new Error("not a tar: a malformed pax header");
    const record = decoder.decode(data.subarray(space + 1, at + length - 1));
    const equals = record.indexOf("=");
    if (record.slice(0, equals) === "path") path = record.slice(equals + 1);
    at += length;
  }
  return path;
}
