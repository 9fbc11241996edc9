"""The edit tool (Anthropic's text editor tool): view, create and edit files."""

from __future__ import annotations

from typing import Annotated, Literal

import fastmcp
from pydantic import Field

from services.gateway.mcp import calls, texts
from services.gateway.mcp.calls import REQUEST_BUDGET
from shared.contract import checks, execution


# Long on purpose: the tool's signature is its schema, one parameter per field of
# Anthropic's text editor tool.
def register(mcp: fastmcp.FastMCP, tools: calls.Calls) -> None:
    @mcp.tool(
        name="str_replace_based_edit_tool",
        output_schema=None,
        annotations={"title": "View and edit files", "openWorldHint": False},
        description=(
            "View, create and edit text files in the sandbox (Anthropic's text editor tool). Paths are "
            "absolute, e.g. /workspace/app.py. Commands:\n"
            "* `view`: a file with line numbers (`view_range` [start, end] is 1-indexed and inclusive, "
            "end -1 means to the end of the file), or a directory listing two levels deep.\n"
            "* `create`: write `file_text` to `path`, replacing any existing file.\n"
            "* `str_replace`: replace `old_str`, which must occur exactly once in the file (whitespace "
            "included), with `new_str` (omit `new_str` to delete `old_str`).\n"
            "* `insert`: insert `insert_text` after line `insert_line` (0 inserts at the top).\n"
            "Files over 10 MiB and binary files are refused; use the shell for them. " + texts.SANDBOX_NOTE
        ),
    )
    async def str_replace_based_edit_tool(
        command: Annotated[
            Literal["view", "create", "str_replace", "insert"], Field(description="The operation to perform.")
        ],
        path: Annotated[
            str, Field(description="Absolute path of the file or directory, e.g. /workspace/a.py.")
        ],
        view_range: Annotated[
            list[int] | None,
            Field(description="For view: [start_line, end_line], e.g. [10, 40] or [10, -1]."),
        ] = None,
        file_text: Annotated[
            str | None, Field(description="For create: the whole content of the file.")
        ] = None,
        old_str: Annotated[
            str | None, Field(description="For str_replace: the exact text to replace (must be unique).")
        ] = None,
        new_str: Annotated[str | None, Field(description="For str_replace: the replacement text.")] = None,
        insert_line: Annotated[
            int | None, Field(description="For insert: the line after which to insert (0 = top of file).")
        ] = None,
        insert_text: Annotated[str | None, Field(description="For insert: the text to insert.")] = None,
    ) -> str:
        with calls.tool_errors():
            who = tools.identity()
            checks.path(path)
            if command == "create":
                calls.required(file_text, "file_text", command)
            elif command == "str_replace":
                calls.required(old_str, "old_str", command)
            elif command == "insert":
                calls.required(insert_line, "insert_line", command)
                if insert_text is None:  # older versions of the tool sent the text as new_str
                    insert_text, new_str = new_str, None
                calls.required(insert_text, "insert_text", command)
            reply = await tools.run(
                who,
                lambda **f: execution.Edit(
                    command=command,
                    path=path,
                    view_range=view_range,
                    file_text=file_text,
                    old_str=old_str,
                    new_str=new_str,
                    insert_line=insert_line,
                    insert_text=insert_text,
                    **f,
                ),
                REQUEST_BUDGET,
            )
            return reply.output
