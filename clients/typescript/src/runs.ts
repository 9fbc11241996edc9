/** A run's answer: NDJSON, one event a line, read as it comes. */

import { SandboxApiError } from "./errors.js";
import type { components, operations } from "./openapi.js";

type Schemas = components["schemas"];

/** One line of a run's output stream: stdout, stderr, listing, keepalive, then exit or error. */
export type RunEvent = operations["runCommand"]["responses"][200]["content"]["application/x-ndjson"];
export type StdoutEvent = Schemas["Stdout"];
export type StderrEvent = Schemas["Stderr"];
export type ListingEvent = Schemas["Listing"];
export type ExitEvent = Schemas["Exit"];
export type RunErrorEvent = Schemas["Failed"];
export type KeepaliveEvent = Schemas["Keepalive"];

/** What `SandboxClient.run` collects from a run that ran. */
export interface RunResult {
  stdout: string;
  stderr: string;
  /** The command's exit status; null when it had none (it timed out and was killed). */
  exitCode: number | null;
  timedOut: boolean;
  /** The exit event as the server sent it (duration, sandbox id, notes). */
  exit: ExitEvent;
}

/**
 * A started run: iterate it for its events as they come (once). Leaving the loop early
 * (break, a throw) or aborting the signal given to `stream` closes the connection, and
 * the server then kills the command.
 */
export class RunStream implements AsyncIterable<RunEvent> {
  /** Names the run (the `X-Run-Id` header): `stop()` uses it. */
  readonly runId: string;
  /** The sandbox that runs it (the `X-Sandbox-Id` header). */
  readonly sandboxId: string;
  private readonly body: ReadableStream<Uint8Array>;
  private readonly stopper: () => Promise<void>;
  private used = false;

  /** @internal */
  constructor(response: Response, stop: (runId: string) => Promise<void>) {
    if (response.body === null) throw new Error("the run's answer has no body");
    this.body = response.body;
    this.runId = response.headers.get("x-run-id") ?? "";
    this.sandboxId = response.headers.get("x-sandbox-id") ?? "";
    this.stopper = () => stop(this.runId);
  }

  /** Ask the server to kill the command (its exit event still comes, as the last). */
  stop(): Promise<void> {
    return this.stopper();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<RunEvent> {
    if (this.used) throw new Error("a run's events can be read once");
    this.used = true;
    const reader = this.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let ended = false;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
        let newline: number;
        while ((newline = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, newline);
          buffer = buffer.slice(newline + 1);
          if (!line.trim()) continue;
          const event = JSON.parse(line) as RunEvent;
          ended = event.type === "exit" || event.type === "error";
          yield event;
          if (ended) return;
        }
        if (done) break;
      }
      throw new Error(
        "the run's output ended before its exit event (the connection was lost): its outcome is unknown",
      );
    } finally {
      if (!ended) await reader.cancel().catch(() => undefined); // closes the connection: the run is killed
      reader.releaseLock();
    }
  }

  /**
   * Read the rest: stdout and stderr as text, with the exit. A run that failed (its last
   * event is an `error`) throws its {@link SandboxApiError}.
   */
  async result(): Promise<RunResult> {
    const stdout: string[] = [];
    const stderr: string[] = [];
    for await (const event of this) {
      switch (event.type) {
        case "stdout":
          stdout.push(event.data);
          break;
        case "stderr":
          stderr.push(event.data);
          break;
        case "error":
          throw new SandboxApiError(event);
        case "exit":
          return {
            stdout: stdout.join(""),
            stderr: stderr.join(""),
            exitCode: event.exit_code ?? null,
            timedOut: event.timed_out ?? false,
            exit: event,
          };
      }
    }
    throw new Error("unreachable: the events end with exit or error");
  }
}
