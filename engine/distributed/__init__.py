"""engine/distributed"""
