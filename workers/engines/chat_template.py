"""The Qwen-style ChatML chat template used by the tiny model (and usable with any ChatML model).

Rendering rules (what a prompt looks like token for token):

- A system turn is emitted when the first message is a system message or tools are given. With
  tools, the system turn lists each OpenAI function schema as one JSON line inside
  ``<tools></tools>`` and explains the ``<tool_call>`` format.
- An assistant turn renders ``reasoning_content`` as ``<think>\\n…\\n</think>\\n\\n``, then the
  content, then each tool call as ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``.
  Unlike Qwen3's own template, reasoning of earlier turns is kept, so a conversation renders
  as a strict prefix of its continuation (no retroactive edits of history).
- Consecutive ``tool`` messages are grouped into one user turn of ``<tool_response>`` blocks.
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE", "TOOL_SYSTEM_PREAMBLE"]

TOOL_SYSTEM_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)

_TOOL_SYSTEM_SUFFIX = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_literal(text: str) -> str:
    """Quote ``text`` as a Jinja string literal (single quotes, escaped newlines)."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return "'" + escaped + "'"


CHAT_TEMPLATE = (
    "{%- set ns = namespace(offset=0) %}\n"
    "{%- if messages and messages[0].role == 'system' %}{%- set ns.offset = 1 %}{%- endif %}\n"
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if ns.offset == 1 %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- " + _jinja_literal(TOOL_SYSTEM_PREAMBLE) + " }}\n"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\n"
    "{{- " + _jinja_literal(_TOOL_SYSTEM_SUFFIX + "<|im_end|>\n") + " }}\n"
    "{%- elif ns.offset == 1 %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages[ns.offset:] %}\n"
    "{%- set index = ns.offset + loop.index0 %}\n"
    "{%- if message.role == 'user' or message.role == 'system' %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'assistant' %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}\n"
    "{%- if message.content %}{{- message.content }}{%- endif %}\n"
    "{%- if message.tool_calls %}\n"
    "{%- for tool_call in message.tool_calls %}\n"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}\n"
    "{%- if tool_call.function %}{%- set fn = tool_call.function %}"
    "{%- else %}{%- set fn = tool_call %}{%- endif %}\n"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}\n"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson }}{%- endif %}\n"
    "{{- '}\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- elif message.role == 'tool' %}\n"
    "{%- if index == ns.offset or messages[index - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}\n"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "{%- if loop.last or messages[index + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
