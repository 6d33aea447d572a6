"""engine/entrypoints/openai/tool_parsers"""
