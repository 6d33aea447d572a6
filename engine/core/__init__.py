"""engine/core"""
