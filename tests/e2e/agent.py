"""An agent as tests play it: the official MCP client over streamable HTTP (one connection
per call, as agents' hosts do) and the tools it must see."""

from __future__ import annotations

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

TOOLS = {
    "create_sandbox", "clear_session", "shell", "shell_async", "shell_poll", "shell_wait", "shell_stop",
    "str_replace_based_edit_tool",
}  # fmt: skip


class Agent:
    def __init__(self, url: str, key: str, session: str, **headers: str) -> None:
        self.url, self.session = f"{url}/mcp", session
        self.headers = {"Authorization": f"Bearer {key}", "X-Session-Id": session, **headers}

    async def call(self, tool: str, **arguments) -> tuple[bool, str]:
        async with httpx2.AsyncClient(headers=self.headers, timeout=120) as http:
            async with streamable_http_client(self.url, http_client=http) as (read, write):
                async with ClientSession(read, write) as mcp:
                    await mcp.initialize()
                    result = await mcp.call_tool(tool, arguments)
        text = "".join(getattr(c, "text", "") for c in result.content)
        return not result.is_error, text

    async def tools(self) -> set[str]:
        async with httpx2.AsyncClient(headers=self.headers, timeout=60) as http:
            async with streamable_http_client(self.url, http_client=http) as (read, write):
                async with ClientSession(read, write) as mcp:
                    await mcp.initialize()
                    return {t.name for t in (await mcp.list_tools()).tools}
