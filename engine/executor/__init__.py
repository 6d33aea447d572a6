"""engine/executor"""
