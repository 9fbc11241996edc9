/**
 * The client: sessions, runs with streamed output, and files, over the gateway's REST API.
 * Request and answer types are the generated ones (src/openapi.ts), so a change of the API
 * that this code does not follow fails to compile.
 */

import { SandboxApiError } from "./errors.js";
import type { components, operations } from "./openapi.js";
import { RunStream, type RunResult } from "./runs.js";
import { tar, untar } from "./tar.js";

type Schemas = components["schemas"];

export type Session = Schemas["Session"];
export type SessionList = Schemas["SessionList"];
export type CreateSessionRequest = Schemas["CreateSessionRequest"];
export type ListSessionsQuery = NonNullable<operations["listSessions"]["parameters"]["query"]>;
export type RunBody = Schemas["RunBody"];
export type ArchiveWritten = Schemas["ArchiveWritten"];
export type Snapshot = Schemas["Snapshot"];
export type SnapshotList = Schemas["SnapshotList"];
export type Forks = Schemas["Forks"];
export type ListSnapshotsQuery = NonNullable<operations["listSnapshots"]["parameters"]["query"]>;

export interface SandboxClientOptions {
  /** The gateway, e.g. `http://127.0.0.1:8080` (what `sbx up` prints, without `/v1/...`). */
  url: string;
  /** `SANDBOX_API_KEY`, sent as `Authorization: Bearer <key>`. */
  apiKey: string;
  /** Sent as `X-Org-Id` on every request: the organisation sessions are attributed to. */
  orgId?: string;
  /** Sent as `X-User-Id` on every request. */
  userId?: string;
  /** A `fetch` to use instead of the global one. */
  fetch?: typeof fetch;
}

export interface RequestOptions {
  signal?: AbortSignal;
}

export interface WriteOptions extends RequestOptions {
  /** Makes a retry safe: the same key never causes a second transition. */
  idempotencyKey?: string;
}

export interface ArchiveOptions extends RequestOptions {
  /** A directory under /workspace; the tar's paths are relative to it (default /workspace). */
  root?: string;
}

export interface DownloadOptions extends ArchiveOptions {
  /** Paths to include, relative to the root (directories whole); none: the whole root. */
  paths?: string[];
}

type TarBody = Uint8Array | Blob | ReadableStream<Uint8Array>;

export class SandboxClient {
  /** The session registry: create, list, get, stop, delete. */
  readonly sessions: Sessions;
  /** Snapshots of sessions' files: take, list, get, delete, keep warm, fork, restore. */
  readonly snapshots: Snapshots;
  private readonly base: string;
  private readonly headers: Record<string, string>;
  private readonly fetcher: typeof fetch;

  constructor(options: SandboxClientOptions) {
    this.base = options.url.replace(/\/+$/, "");
    this.headers = { authorization: `Bearer ${options.apiKey}` };
    if (options.orgId !== undefined) this.headers["x-org-id"] = options.orgId;
    if (options.userId !== undefined) this.headers["x-user-id"] = options.userId;
    const fetcher = options.fetch ?? globalThis.fetch;
    this.fetcher = (input, init) => fetcher(input, init); // (a browser's fetch must not be called as a method)
    this.sessions = new Sessions(this);
    this.snapshots = new Snapshots(this);
  }

  /**
   * Start a command in the session's sandbox (a session with none is given one) and
   * answer once it runs: iterate the answer for its events as they come. Aborting
   * `signal`, or leaving the loop early, kills the command.
   */
  async stream(sessionId: string, body: RunBody, options: RequestOptions = {}): Promise<RunStream> {
    const response = await this.request("POST", `${sessionPath(sessionId)}/run`, {
      body: JSON.stringify(body),
      headers: { "content-type": "application/json", accept: "application/x-ndjson" },
      signal: options.signal,
    });
    return new RunStream(response, async (runId) => {
      await this.request("POST", `${sessionPath(sessionId)}/runs/${encodeURIComponent(runId)}/stop`);
    });
  }

  /**
   * Run a command and collect its output: stdout, stderr, the exit code. A non-zero exit
   * or a timeout is a result (`exitCode`, `timedOut`), not an error.
   */
  async run(sessionId: string, body: RunBody, options: RequestOptions = {}): Promise<RunResult> {
    return (await this.stream(sessionId, body, options)).result();
  }

  /** Upload a tar and extract it into `root` (created if missing). */
  async uploadArchive(sessionId: string, archive: TarBody, options: ArchiveOptions = {}): Promise<ArchiveWritten> {
    const query = new URLSearchParams();
    if (options.root !== undefined) query.set("root", options.root);
    const streamed = typeof ReadableStream !== "undefined" && archive instanceof ReadableStream;
    const response = await this.request("PUT", `${sessionPath(sessionId)}/archive${suffix(query)}`, {
      body: archive as BodyInit,
      headers: { "content-type": "application/x-tar" },
      signal: options.signal,
      ...(streamed ? { duplex: "half" } : {}), // (fetch needs it to send a stream)
    });
    return (await response.json()) as ArchiveWritten;
  }

  /**
   * Download paths as a tar, streamed. A failure after the answer started errors the
   * stream (the server breaks the connection): a truncated tar never looks whole. The
   * session must have a running sandbox (a download never starts one).
   */
  async downloadArchive(
    sessionId: string,
    options: DownloadOptions = {},
  ): Promise<ReadableStream<Uint8Array>> {
    const query = new URLSearchParams();
    if (options.root !== undefined) query.set("root", options.root);
    for (const path of options.paths ?? []) query.append("path", path);
    const response = await this.request("GET", `${sessionPath(sessionId)}/archive${suffix(query)}`, {
      headers: { accept: "application/x-tar" },
      signal: options.signal,
    });
    if (response.body === null) throw new Error("the download's answer has no body");
    return response.body;
  }

  /**
   * Write one file: `path` is absolute (under /workspace) or relative to /workspace;
   * missing directories are created.
   */
  async writeFile(
    sessionId: string,
    path: string,
    data: string | Uint8Array,
    options: RequestOptions & { mode?: number } = {},
  ): Promise<void> {
    const { root, name } = place(path);
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    const file = options.mode === undefined ? { name, data: bytes } : { name, data: bytes, mode: options.mode };
    await this.uploadArchive(sessionId, tar([file]), { root, signal: options.signal });
  }

  /** Read one regular file (absolute, or relative to /workspace), as bytes. */
  async readFile(sessionId: string, path: string, options: RequestOptions = {}): Promise<Uint8Array> {
    const { root, name } = place(path);
    const stream = await this.downloadArchive(sessionId, { root, paths: [name], signal: options.signal });
    const files = untar(new Uint8Array(await new Response(stream).arrayBuffer()));
    const file = files.find((f) => f.name.replace(/^\.\//, "") === name);
    if (file === undefined) throw new Error(`the download of ${JSON.stringify(path)} did not hold it`);
    return file.data;
  }

  /** @internal One API call; a non-success answer throws its {@link SandboxApiError}. */
  async request(
    method: string,
    path: string,
    init: Omit<RequestInit, "method"> & { headers?: Record<string, string>; duplex?: string } = {},
  ): Promise<Response> {
    const response = await this.fetcher(this.base + path, {
      ...init,
      method,
      headers: { ...this.headers, ...init.headers },
    } as RequestInit);
    if (!response.ok) throw await SandboxApiError.of(response);
    return response;
  }
}

/** The session registry (`client.sessions`). */
export class Sessions {
  constructor(private readonly client: SandboxClient) {}

  /** Register a session id (409 `conflict` if it exists). */
  async create(body: CreateSessionRequest, options: WriteOptions = {}): Promise<Session> {
    const response = await this.client.request("POST", "/v1/sessions", {
      body: JSON.stringify(body),
      headers: { "content-type": "application/json", ...idempotency(options) },
      signal: options.signal,
    });
    return (await response.json()) as Session;
  }

  /** A page of sessions matching the filters, oldest first (deleted ones only with
   * `status: "deleted"`); pass its `next_cursor` as `cursor` (same filters) for the next. */
  async list(query: ListSessionsQuery = {}, options: RequestOptions = {}): Promise<SessionList> {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined) params.set(key, String(value));
    }
    const response = await this.client.request("GET", `/v1/sessions${suffix(params)}`, options);
    return (await response.json()) as SessionList;
  }

  async get(sessionId: string, options: RequestOptions = {}): Promise<Session> {
    const response = await this.client.request("GET", sessionPath(sessionId), options);
    return (await response.json()) as Session;
  }

  /** Stop the session's sandbox (idempotent); its files are kept. */
  async stop(sessionId: string, options: WriteOptions = {}): Promise<Session> {
    const response = await this.client.request("POST", `${sessionPath(sessionId)}/stop`, {
      headers: idempotency(options),
      signal: options.signal,
    });
    return (await response.json()) as Session;
  }

  /** Delete the session, its sandbox and its files. */
  async delete(sessionId: string, options: WriteOptions = {}): Promise<void> {
    await this.client.request("DELETE", sessionPath(sessionId), {
      headers: idempotency(options),
      signal: options.signal,
    });
  }
}

/** Snapshots of sessions' files (`client.snapshots`). */
export class Snapshots {
  constructor(private readonly client: SandboxClient) {}

  /** Snapshot the session's files (its processes frozen while they are copied). */
  async take(sessionId: string, options: WriteOptions & { snapshotId?: string } = {}): Promise<Snapshot> {
    const body = options.snapshotId === undefined ? {} : { snapshot_id: options.snapshotId };
    return (await this.post(`${sessionPath(sessionId)}/snapshots`, body, options)) as Snapshot;
  }

  /** A page of snapshots matching the filters, oldest first; `next_cursor` continues it. */
  async list(query: ListSnapshotsQuery = {}, options: RequestOptions = {}): Promise<SnapshotList> {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined) params.set(key, String(value));
    }
    const response = await this.client.request("GET", `/v1/snapshots${suffix(params)}`, options);
    return (await response.json()) as SnapshotList;
  }

  async get(snapshotId: string, options: RequestOptions = {}): Promise<Snapshot> {
    const response = await this.client.request("GET", snapshotPath(snapshotId), options);
    return (await response.json()) as Snapshot;
  }

  /** Delete it; sessions forked or restored from it keep their files. */
  async delete(snapshotId: string, options: WriteOptions = {}): Promise<void> {
    await this.client.request("DELETE", snapshotPath(snapshotId), {
      headers: idempotency(options),
      signal: options.signal,
    });
  }

  /**
   * Keep `count` (0 to 100) idle sandboxes started from the snapshot ready, so its forks
   * and restores claim one instead of starting one; `warm_ready` says how many are ready.
   */
  async warm(snapshotId: string, count: number, options: RequestOptions = {}): Promise<Snapshot> {
    const response = await this.client.request("PUT", `${snapshotPath(snapshotId)}/warm`, {
      body: JSON.stringify({ count }),
      headers: { "content-type": "application/json" },
      signal: options.signal,
    });
    return (await response.json()) as Snapshot;
  }

  /** New sessions (a count, or named) whose sandboxes start from the snapshot. */
  async fork(
    snapshotId: string,
    wanted: { count: number } | { session_ids: string[] },
    options: WriteOptions = {},
  ): Promise<Forks> {
    return (await this.post(`${snapshotPath(snapshotId)}/forks`, wanted, options)) as Forks;
  }

  /** Put the session back to the snapshot: a new sandbox from it replaces the session's. */
  async restore(sessionId: string, snapshotId: string, options: WriteOptions = {}): Promise<Session> {
    const body = { snapshot_id: snapshotId };
    return (await this.post(`${sessionPath(sessionId)}/restore`, body, options)) as Session;
  }

  private async post(path: string, body: unknown, options: WriteOptions): Promise<unknown> {
    const response = await this.client.request("POST", path, {
      body: JSON.stringify(body),
      headers: { "content-type": "application/json", ...idempotency(options) },
      signal: options.signal,
    });
    return response.json();
  }
}

function snapshotPath(snapshotId: string): string {
  return `/v1/snapshots/${encodeURIComponent(snapshotId)}`;
}

function sessionPath(sessionId: string): string {
  return `/v1/sessions/${encodeURIComponent(sessionId)}`;
}

function suffix(query: URLSearchParams): string {
  const text = query.toString();
  return text ? `?${text}` : "";
}

function idempotency(options: WriteOptions): Record<string, string> {
  return options.idempotencyKey === undefined ? {} : { "idempotency-key": options.idempotencyKey };
}

/** Where a file goes in the archive API: the directory it is in (the root), and its name
 * there. A relative path keeps the server's default root (/workspace). */
function place(path: string): { root: string | undefined; name: string } {
  if (path === "" || path.endsWith("/")) throw new Error(`not a file path: ${JSON.stringify(path)}`);
  if (!path.startsWith("/")) return { root: undefined, name: path };
  const slash = path.lastIndexOf("/");
  return { root: path.slice(0, slash) || "/", name: path.slice(slash + 1) };
}
