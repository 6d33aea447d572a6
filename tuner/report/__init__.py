"""tuner/report"""
