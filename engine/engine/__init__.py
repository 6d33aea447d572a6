"""engine/engine"""
