/** The one error the API answers with: its JSON Problem body, as an exception. */

import type { components } from "./openapi.js";

/** Every error body of the REST API (and the last event of a run that failed). */
export type Problem = components["schemas"]["Problem"];

/**
 * An error the API answered: a non-2xx status with its Problem body, or a run whose last
 * event was an `error`. `code` is the server's stable machine-readable code
 * (`invalid_input`, `not_found`, `conflict`, ...); `retriable` says a retry may succeed.
 */
export class SandboxApiError extends Error {
  readonly status: number;
  readonly code: string;
  readonly retriable: boolean;

  constructor(problem: Problem) {
    super(problem.message);
    this.name = "SandboxApiError";
    this.status = problem.status;
    this.code = problem.error;
    this.retriable = problem.retriable ?? false;
  }

  /** The error of a response that is not a success (its body is read). */
  static async of(response: Response): Promise<SandboxApiError> {
    const text = await response.text();
    let problem: Problem | undefined;
    try {
      problem = JSON.parse(text) as Problem;
    } catch {
      // Not from the gateway (something in between answered): keep what it said.
    }
    if (problem === undefined || typeof problem.error !== "string") {
      return new SandboxApiError({
        error: `http_${response.status}`,
        message: `${response.status} ${response.statusText}: ${text.slice(0, 500)}`.trim(),
        status: response.status,
        retriable: false,
      });
    }
    return new SandboxApiError({ ...problem, status: problem.status ?? response.status });
  }
}
