"""engine/cpu"""
