"""tuner/cluster"""
