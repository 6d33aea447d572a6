"""tuner/measure"""
