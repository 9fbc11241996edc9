// The npm SDK's signed file URLs for the sandbox named in argv[2], printed as JSON, run by
// tests/e2e/test_e2b_hosts.py without E2B_SANDBOX_URL (so the SDK builds them on
// https://49983-{sandboxId}.{domain}, the domain the stack's connect answered).
import { Sandbox } from "e2b";

const sandbox = await Sandbox.connect(process.argv[2]);
console.log(
  JSON.stringify({
    domain: sandbox.sandboxDomain,
    upload: await sandbox.uploadUrl("/tmp/node-up.txt"),
    download: await sandbox.downloadUrl("/tmp/node-up.txt", { useSignatureExpiration: 600 }),
  }),
);
