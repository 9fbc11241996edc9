// What the tests share: a client for the stack named by SBX_URL and SANDBOX_API_KEY, and
// session ids no other test uses.
import { randomUUID } from "node:crypto";
import { SandboxClient, type SandboxClientOptions } from "@cloud-agent-sandbox/client";

export function settings(): { url: string; apiKey: string } {
  const url = process.env.SBX_URL;
  const apiKey = process.env.SANDBOX_API_KEY;
  if (!url || !apiKey) {
    throw new Error("set SBX_URL and SANDBOX_API_KEY to a running gateway (sbx up prints both)");
  }
  return { url, apiKey };
}

export function client(options: Partial<SandboxClientOptions> = {}): SandboxClient {
  return new SandboxClient({ ...settings(), ...options });
}

export function sessionId(what: string): string {
  return `ts-${what}-${randomUUID().slice(0, 8)}`;
}

/** Ask `check` until it is true; fail with `what` if it never is. */
export async function eventually(what: string, check: () => Promise<boolean>, tries = 200): Promise<void> {
  for (let i = 0; i < tries; i++) {
    if (await check()) return;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  throw new Error(`never: ${what}`);
}
