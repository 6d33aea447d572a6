"""engine/worker"""
