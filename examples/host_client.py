"""Run an agent's commands in a sandbox from Python, with this host's tree as the source
of truth. Needs a running stack (`scripts/up`) and its key:

    SBX_URL=http://127.0.0.1:8080 SANDBOX_API_KEY=$(cat .sbx/api-key) \
        .venv/bin/python examples/host_client.py /path/to/a/repository

It runs a command that creates a file in the sandbox (it comes back to the host), shows
streamed output, and prints where a git push would run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sbx_client import Sandbox, route


def main() -> None:
    code_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    with Sandbox(cwd=code_dir, session="example-1") as sb:
        result = sb.execute("uname -a; ls | head -n 5; echo 'made in the sandbox' > SANDBOX_NOTE.txt")
        print(result["output"], f"[exit code {result['exit_code']}]")
        print("back on the host:", (code_dir / "SANDBOX_NOTE.txt").read_text().strip())
        streamed = sb.stream(
            "for i in 1 2 3; do echo step $i; sleep 0.2; done",
            output=lambda stream, data: print(f"{stream}: {data.decode()}", end=""),
        )
        print("timings:", {k: f"{v * 1000:.0f} ms" for k, v in streamed.seconds.items()})
    decided = route.route("git push origin HEAD", [code_dir], code_dir)
    print(f"`git push origin HEAD` would run on the {decided.where}: {decided.why}")
    (code_dir / "SANDBOX_NOTE.txt").unlink()


if __name__ == "__main__":
    main()
