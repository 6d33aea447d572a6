"""engine/structured_output"""
