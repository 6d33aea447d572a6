"""tuner/local"""
