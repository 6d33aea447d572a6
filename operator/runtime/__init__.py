"""operator/runtime"""
