"""Agent loops: tool definitions, their canonical rendering, tool-call parsing and grammars.

- `tools`       tool definitions and tool_choice, validated; canonical JSON for the prompt
- `chat_format` OpenAI tool conversations -> chat-template messages (the model's template when it
                renders tools, a built-in Hermes/Qwen-style format otherwise)
- `prompt`      prompt token ids in which earlier assistant turns are the ids the model generated
- `tool_parser` tool calls out of generated text, whole or as streamed deltas
- `grammar`     llguidance grammars (JSON Schema, tool calls) and the per-sample token masks
"""
