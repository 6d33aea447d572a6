"""operator/render"""
