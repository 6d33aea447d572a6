"""engine/entrypoints/openai"""
