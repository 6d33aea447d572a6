"""tuner/search"""
