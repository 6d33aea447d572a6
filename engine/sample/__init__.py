"""engine/sample"""
