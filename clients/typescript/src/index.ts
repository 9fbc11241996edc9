/**
 * Cloud Agent Sandbox client: sessions, runs with streamed output, and files, over the
 * gateway's REST API. No runtime dependencies: the global `fetch` and web streams (Node 18+,
 * browsers, Deno, Bun).
 */

export {
  SandboxClient,
  Sessions,
  Snapshots,
  type ArchiveOptions,
  type ArchiveWritten,
  type CreateSessionRequest,
  type DownloadOptions,
  type Forks,
  type ListSessionsQuery,
  type ListSnapshotsQuery,
  type RequestOptions,
  type RunBody,
  type SandboxClientOptions,
  type Session,
  type SessionList,
  type Snapshot,
  type SnapshotList,
  type WriteOptions,
} from "./client.js";
export { SandboxApiError, type Problem } from "./errors.js";
export {
  RunStream,
  type ExitEvent,
  type KeepaliveEvent,
  type ListingEvent,
  type RunErrorEvent,
  type RunEvent,
  type RunResult,
  type StderrEvent,
  type StdoutEvent,
} from "./runs.js";
export { tar, untar, type TarFile } from "./tar.js";
export type { components, operations, paths } from "./openapi.js";
