"""engine/metrics"""
